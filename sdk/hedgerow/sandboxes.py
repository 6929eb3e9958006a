"""Listing the team's sandboxes (``client.sandboxes`` / ``async_client.sandboxes``).

    for sb in client.sandboxes.list(state="ready", labels={"run": "r1"}):   # every page
        print(sb.id, sb.data["labels"])
    page = client.sandboxes.list_page(limit=100)                             # one page
    more = client.sandboxes.list_page(limit=100, cursor=page.next_cursor)

``list`` iterates cursor pages as it goes (one request per ``page_size`` sandboxes),
newest first. Cursor pages are keyset pages on (created_at, id): a sandbox created or
deleted while you iterate never makes another repeat or go missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Dict,
    Generic,
    Iterator,
    List,
    Optional,
    TypeVar,
)

if TYPE_CHECKING:
    from hedgerow.aio import AsyncClient, AsyncSandbox
    from hedgerow.client import Client, Sandbox

# A label filter: key → value (that value), or key → None (the label is present).
LabelFilter = Optional[Dict[str, Optional[str]]]
MAX_PAGE = 1000  # the server's largest page
T = TypeVar("T")


@dataclass(frozen=True)
class SandboxPage(Generic[T]):
    """One page of sandboxes, newest first: ``sandboxes``, ``next_cursor`` (None on the
    last page) and ``count``: how many match the filters in all, on the first page
    (``cursor=None``); None on a later page (the server counts once per listing)."""

    sandboxes: List[T]
    next_cursor: Optional[str]
    count: Optional[int]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def _count(body: Dict[str, Any]) -> Optional[int]:
    count = body.get("count")
    return None if count is None else int(count)


def list_params(
    *,
    state: Optional[str],
    image: Optional[str],
    labels: LabelFilter,
    limit: int,
    cursor: Optional[str],
) -> List[tuple[str, Any]]:
    """Query parameters of one page (``label`` repeats, so a list of pairs)."""
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"a page holds 1 to {MAX_PAGE} sandboxes, not {limit}")
    params: List[tuple[str, Any]] = [("limit", limit)]
    if state:
        params.append(("state", state))
    if image:
        params.append(("image", image))
    for key, value in sorted((labels or {}).items()):
        params.append(("label", key if value is None else f"{key}={value}"))
    if cursor:
        params.append(("cursor", cursor))
    return params


class Sandboxes:
    """The team's sandboxes, listed with filters one cursor page at a time."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def list_page(
        self,
        *,
        state: Optional[str] = None,
        image: Optional[str] = None,
        labels: LabelFilter = None,
        limit: int = 50,
        cursor: Optional[str] = None,
    ) -> SandboxPage[Sandbox]:
        """One page: at most ``limit`` (1-1000, default 50) sandboxes after ``cursor``
        (a previous page's ``next_cursor``), newest first. ``state``: a state or a comma
        list (``"ready,provisioning"``); ``image``: exact image name; ``labels``: every
        ``{key: value}`` must match, ``{key: None}`` means the label is present."""
        params = list_params(state=state, image=image, labels=labels, limit=limit, cursor=cursor)
        body = self._client.request("GET", "/sandboxes", params=params).json()
        return SandboxPage(
            sandboxes=[self._client._sandbox(item) for item in body["results"]],
            next_cursor=body.get("next_cursor"),
            count=_count(body),
            raw=body,
        )

    def list(
        self,
        *,
        state: Optional[str] = None,
        image: Optional[str] = None,
        labels: LabelFilter = None,
        limit: Optional[int] = None,
        page_size: int = 100,
    ) -> Iterator[Sandbox]:
        """Every matching sandbox, newest first, fetched ``page_size`` (default 100) at
        a time as you iterate; at most ``limit`` (default: all). Filters as
        ``list_page``."""
        cursor: Optional[str] = None
        left = limit
        while left is None or left > 0:
            size = page_size if left is None else min(page_size, left)
            page = self.list_page(
                state=state, image=image, labels=labels, limit=size, cursor=cursor
            )
            yield from page.sandboxes
            if left is not None:
                left -= len(page.sandboxes)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor


class AsyncSandboxes:
    """The asyncio twin of ``Sandboxes`` (``async for sb in client.sandboxes.list()``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list_page(
        self,
        *,
        state: Optional[str] = None,
        image: Optional[str] = None,
        labels: LabelFilter = None,
        limit: int = 50,
        cursor: Optional[str] = None,
    ) -> SandboxPage[AsyncSandbox]:
        """See ``Sandboxes.list_page``."""
        params = list_params(state=state, image=image, labels=labels, limit=limit, cursor=cursor)
        body = (await self._client.request("GET", "/sandboxes", params=params)).json()
        return SandboxPage(
            sandboxes=[self._client._sandbox(item) for item in body["results"]],
            next_cursor=body.get("next_cursor"),
            count=_count(body),
            raw=body,
        )

    async def list(
        self,
        *,
        state: Optional[str] = None,
        image: Optional[str] = None,
        labels: LabelFilter = None,
        limit: Optional[int] = None,
        page_size: int = 100,
    ) -> AsyncIterator[AsyncSandbox]:
        """See ``Sandboxes.list``."""
        cursor: Optional[str] = None
        left = limit
        while left is None or left > 0:
            size = page_size if left is None else min(page_size, left)
            page = await self.list_page(
                state=state, image=image, labels=labels, limit=size, cursor=cursor
            )
            for sandbox in page.sandboxes:
                yield sandbox
            if left is not None:
                left -= len(page.sandboxes)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor
