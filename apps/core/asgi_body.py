"""Reading a request body ahead of Django in an ASGI middleware, and handing what was
read back to Django unchanged: the two fast paths (REST exec, E2B envd Start) look at
a body first and pass the request on when they do not answer it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def read_body(receive: Receive, max_body: int) -> tuple[bytes, bool]:
    """The body, and whether it is complete (False: over ``max_body``, rest unread, or
    the client disconnected — Django deals with either)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True
        if size > max_body:
            return b"".join(chunks), False


def replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """A ``receive`` that yields what was already read, then the rest of the stream."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not complete}
        return await receive()

    return replayed
