"""Keyset ("cursor") pages, newest first, for the dashboard's lists.

A page is the rows after the cursor's (created_at, id) in ``-created_at, -id`` order:
unlike an offset it stays correct while rows are created or deleted, and every row is
reachable. A cursor is opaque (url-safe base64 of the last row's time and id); one that
does not decode starts over at the newest page, as the sandboxes list does.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.db import models
from django.db.models import Q, QuerySet
from drf_spectacular.utils import OpenApiParameter

from apps.core.errors import ValidationFailed

M = TypeVar("M", bound=models.Model)


@dataclass(frozen=True)
class KeysetPage(Generic[M]):
    rows: list[M]
    next_cursor: str  # "" on the last page


def newest_first(
    qs: QuerySet[M], *, cursor: str = "", limit: int = 50, time_field: str = "created_at"
) -> KeysetPage[M]:
    """One page of ``qs`` (a model with a ``time_field`` and a UUID or integer ``id``)."""
    after = _decode(cursor, _pk_parser(qs))
    if after is not None:
        at, pk = after
        qs = qs.filter(Q(**{f"{time_field}__lt": at}) | Q(**{time_field: at, "id__lt": pk}))
    rows = list(qs.order_by(f"-{time_field}", "-id")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = ""
    if more:
        last = rows[-1]
        next_cursor = encode_cursor(getattr(last, time_field), last.pk)
    return KeysetPage(rows, next_cursor)


API_PAGE_MAX = 200

# the two query parameters of a keyset-paged API list, for its OpenAPI entry
CURSOR_DOCS = [
    OpenApiParameter(
        "cursor", str, description="empty or absent for the first page, then `next_cursor`"
    ),
    OpenApiParameter("limit", int, description="rows per page"),
]


def api_page_size(limit: str | None, *, default: int = 50, most: int = API_PAGE_MAX) -> int:
    """A keyset page's ``limit`` query parameter: ``default`` when absent, else
    1..``most`` (a typed 400 naming ``limit`` otherwise)."""
    if not limit:
        return default
    try:
        size = int(limit)
    except ValueError:
        raise ValidationFailed("limit must be an integer", field="limit") from None
    if not 1 <= size <= most:
        raise ValidationFailed(f"limit must be 1..{most}", field="limit")
    return size


def api_keyset_page(
    qs: QuerySet[M],
    *,
    cursor: str,
    limit: str | None,
    default: int = 50,
    most: int = API_PAGE_MAX,
    time_field: str = "created_at",
) -> tuple[list[M], str | None]:
    """The API's keyset page (``newest_first``) for a list that also keeps its offset
    pages: ``limit`` 1..200 (default 50), a cursor this server did not give is a 400
    (a client must learn it is wrong; the dashboard starts over), the next cursor None on
    the last page. No count: a walk's cost follows the page, not the table."""
    size = api_page_size(limit, default=default, most=most)
    if cursor:
        after = _decode(cursor, _pk_parser(qs))
        if after is None or after[0].tzinfo is None:
            raise ValidationFailed("cursor is not a cursor this server gave", field="cursor")
    page = newest_first(qs, cursor=cursor, limit=size, time_field=time_field)
    return page.rows, page.next_cursor or None


def api_key_page(
    qs: QuerySet[M],
    *,
    key: str,
    cursor: str,
    limit: str | None,
    default: int = 50,
    most: int = API_PAGE_MAX,
) -> tuple[list[M], str | None]:
    """The API's keyset page of a list ordered by a unique text ``key`` (ascending), e.g.
    a team's tasks by task id: the rows after the cursor's key. A cursor this server did
    not give is a 400; the next cursor is None on the last page."""
    size = api_page_size(limit, default=default, most=most)
    if cursor:
        try:
            after = _unb64(cursor)
        except (ValueError, UnicodeDecodeError):
            raise ValidationFailed(
                "cursor is not a cursor this server gave", field="cursor"
            ) from None
        qs = qs.filter(**{f"{key}__gt": after})
    rows = list(qs.order_by(key)[: size + 1])
    if len(rows) <= size:
        return rows, None
    rows = rows[:size]
    last = str(getattr(rows[-1], key))
    return rows, base64.urlsafe_b64encode(last.encode()).decode().rstrip("=")


def encode_cursor(at: datetime, pk: object) -> str:
    raw = f"{at.isoformat()}|{pk}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID] | None:
    """A cursor of a model with a UUID ``id``; None for one that does not decode."""
    return _decode(cursor, uuid.UUID)


P = TypeVar("P")


def _decode(cursor: str, parse_pk: Callable[[str], P]) -> tuple[datetime, P] | None:
    if not cursor:
        return None
    try:
        at, pk = _unb64(cursor).split("|", 1)
        return datetime.fromisoformat(at), parse_pk(pk)
    except (ValueError, UnicodeDecodeError):
        return None


def _unb64(cursor: str) -> str:
    """A cursor's text: url-safe base64 without its padding (a character outside the
    alphabet is a ValueError, not skipped)."""
    padded = cursor + "=" * (-len(cursor) % 4)
    return base64.b64decode(padded, altchars=b"-_", validate=True).decode()


def _pk_parser(qs: QuerySet[Any]) -> Callable[[str], Any]:
    # a cursor's id is parsed as the model's key is typed: a UUID cursor given to a list
    # of integer ids (or the reverse) does not decode, rather than failing in the query
    pk = qs.model._meta.pk
    assert pk is not None
    return uuid.UUID if isinstance(pk, models.UUIDField) else int
