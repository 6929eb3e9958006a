"""Keyset ("cursor") pages, newest first, for the dashboard's lists.

A page is the rows after the cursor's (created_at, id) in ``-created_at, -id`` order:
unlike an offset it stays correct while rows are created or deleted, and every row is
reachable. A cursor is opaque (url-safe base64 of the last row's time and id); one that
does not decode starts over at the newest page, as the sandboxes list does.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from django.db import models
from django.db.models import Q, QuerySet

M = TypeVar("M", bound=models.Model)


@dataclass(frozen=True)
class KeysetPage(Generic[M]):
    rows: list[M]
    next_cursor: str  # "" on the last page


def newest_first(qs: QuerySet[M], *, cursor: str = "", limit: int = 50) -> KeysetPage[M]:
    """One page of ``qs`` (a model with ``created_at`` and a UUID ``id``)."""
    after = decode_cursor(cursor)
    if after is not None:
        at, pk = after
        qs = qs.filter(Q(created_at__lt=at) | Q(created_at=at, id__lt=pk))
    rows = list(qs.order_by("-created_at", "-id")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = ""
    if more:
        last = rows[-1]
        next_cursor = encode_cursor(last.created_at, last.pk)  # type: ignore[attr-defined]
    return KeysetPage(rows, next_cursor)


def encode_cursor(at: datetime, pk: uuid.UUID) -> str:
    raw = f"{at.isoformat()}|{pk}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, pk = raw.split("|", 1)
        return datetime.fromisoformat(at), uuid.UUID(pk)
    except (ValueError, UnicodeDecodeError):
        return None
