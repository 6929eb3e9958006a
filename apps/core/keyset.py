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

from apps.core.errors import ValidationFailed

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


API_PAGE_MAX = 200


def api_page_size(limit: str | None) -> int:
    """A keyset page's ``limit`` query parameter: 50 when absent, else 1..200 (a
    typed 400 naming ``limit`` otherwise)."""
    if not limit:
        return 50
    try:
        size = int(limit)
    except ValueError:
        raise ValidationFailed("limit must be an integer", field="limit") from None
    if not 1 <= size <= API_PAGE_MAX:
        raise ValidationFailed(f"limit must be 1..{API_PAGE_MAX}", field="limit")
    return size


def api_keyset_page(
    qs: QuerySet[M], *, cursor: str, limit: str | None
) -> tuple[list[M], str | None]:
    """The API's keyset page (``newest_first``) for a list that also keeps its offset
    pages: ``limit`` 1..200 (default 50), a cursor this server did not give is a 400
    (a client must learn it is wrong; the dashboard starts over), the next cursor None on
    the last page. No count: a walk's cost follows the page, not the table."""
    size = api_page_size(limit)
    if cursor:
        after = decode_cursor(cursor)
        if after is None or after[0].tzinfo is None:
            raise ValidationFailed("cursor is not a cursor this server gave", field="cursor")
    page = newest_first(qs, cursor=cursor, limit=size)
    return page.rows, page.next_cursor or None


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
