"""Admission's typed refusals: what a limit in the way looks like on the wire (status,
code, ``Retry-After`` for limits that free up by themselves, and ``extra`` naming the
limit, its value and the current use). Shared by the admission rules (``quotas.py``)
and the hot-path limits (``limits.py``), which otherwise need nothing of each other."""

from __future__ import annotations

from typing import Any

from apps.core.errors import ApiError


class QuotaExceeded(ApiError):
    """Over a limit that frees up by itself (429 + Retry-After)."""

    status_code = 429
    code = "quota_exceeded"


class QuotaForbidden(ApiError):
    """Over a limit that waiting will not fix (the request itself is too big)."""

    status_code = 403
    code = "quota_exceeded"


class BudgetExhausted(ApiError):
    status_code = 403
    code = "budget_exhausted"


def limit_error(
    cls: type[ApiError], *, limit: str, value: Any, current: Any, message: str, retry: int = 5
) -> ApiError:
    headers = {"Retry-After": str(retry)} if cls.status_code == 429 else None
    return cls(
        message,
        headers=headers,
        extra={"limit": limit, "value": value, "current": current},
    )
