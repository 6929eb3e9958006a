"""Interval ledgers: rows with ``started_at`` and an optional ``ended_at`` (the usage
ledger of sandboxes' compute and the storage ledger of kept state) and which of them
overlap a window. Both ledgers read it; neither needs the other for it."""

from __future__ import annotations

from datetime import datetime
from typing import TypeVar

from django.db.models import Model, Q, QuerySet

from apps.tenancy.models import Tenant

M = TypeVar("M", bound=Model)


def overlapping(
    qs: QuerySet[M], *, start: datetime | None, end: datetime | None, tenant: Tenant | None = None
) -> QuerySet[M]:
    """Rows of an interval ledger (``started_at``/``ended_at``; open rows have no end)
    that overlap ``[start, end)``; either bound may be open."""
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if end is not None:
        qs = qs.filter(started_at__lt=end)
    if start is not None:
        qs = qs.filter(Q(ended_at__isnull=True) | Q(ended_at__gt=start))
    return qs
