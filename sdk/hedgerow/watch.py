"""Watching a directory in a sandbox (``sandbox.watch(path)``)::

    with sandbox.watch("/workspace", recursive=True) as watcher:
        for event in watcher:                 # blocks until something changes
            print(event.type, event.name)     # create / remove / write / chmod / rename

A watcher lives in the sandbox's agent and reports what changed since the last read
(names relative to the watched directory); a read waits up to ``wait`` seconds for a
change. Changes between two reads are coalesced. At most 16 watchers per sandbox and
10000 entries per watched tree; an unread watcher expires after 10 minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, Iterator, List, Optional

from hedgerow.records import FileInfo

if TYPE_CHECKING:
    from hedgerow.aio import AsyncSandbox
    from hedgerow.client import Sandbox

ITER_WAIT_S = 25.0  # each read of an iteration: under the server's 60 s bound


@dataclass(frozen=True)
class FileEvent:
    """One change: ``name`` relative to the watched directory; ``type`` is create,
    remove, write (a file's size or mtime changed), chmod or rename (the old name: the
    new one comes as a create). ``entry``: with ``watch(…, include_entry=True)``, the
    entry as it was when the change was seen (``FileInfo``); None for a remove or a
    rename, for a name gone again, and without ``include_entry``."""

    name: str
    type: str
    entry: Optional[FileInfo] = None


def _events(body: Dict[str, Any]) -> List[FileEvent]:
    return [
        FileEvent(
            str(e["name"]),
            str(e["type"]),
            FileInfo.from_api(e["entry"]) if isinstance(e.get("entry"), dict) else None,
        )
        for e in body.get("events") or []
    ]


class Watcher:
    """A directory watcher (``sandbox.watch``); ``with`` stops it at the end."""

    def __init__(self, sandbox: Sandbox, data: Dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.data = data

    @property
    def id(self) -> str:
        """The watcher's id (``w-`` + 32 hex digits)."""
        return str(self.data["watcher_id"])

    def events(self, wait: float = 0.0) -> List[FileEvent]:
        """What changed since the last read; waits up to ``wait`` seconds (default 0,
        at most 60) for a change, then returns ``[]``."""
        path = f"/sandboxes/{self.sandbox.id}/files/watch/{self.id}"
        response = self.sandbox._client.request(
            "GET", path, params={"wait": wait}, timeout=wait + 30.0
        )
        return _events(response.json())

    def __iter__(self) -> Iterator[FileEvent]:
        """Every change, as it happens (reads of up to 25 s each), until ``stop()`` or
        the watcher's directory is gone (``NotFound``)."""
        while True:
            yield from self.events(wait=ITER_WAIT_S)

    def stop(self) -> None:
        """Stops watching (its events are gone with it)."""
        path = f"/sandboxes/{self.sandbox.id}/files/watch/{self.id}"
        self.sandbox._client.request("DELETE", path)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class AsyncWatcher:
    """The asyncio twin of ``Watcher`` (``async for event in watcher``)."""

    def __init__(self, sandbox: AsyncSandbox, data: Dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.data = data

    @property
    def id(self) -> str:
        """The watcher's id (``w-`` + 32 hex digits)."""
        return str(self.data["watcher_id"])

    async def events(self, wait: float = 0.0) -> List[FileEvent]:
        """See ``Watcher.events``."""
        path = f"/sandboxes/{self.sandbox.id}/files/watch/{self.id}"
        response = await self.sandbox._client.request(
            "GET", path, params={"wait": wait}, timeout=wait + 30.0
        )
        return _events(response.json())

    async def __aiter__(self) -> AsyncIterator[FileEvent]:
        while True:
            for event in await self.events(wait=ITER_WAIT_S):
                yield event

    async def stop(self) -> None:
        """See ``Watcher.stop``."""
        path = f"/sandboxes/{self.sandbox.id}/files/watch/{self.id}"
        await self.sandbox._client.request("DELETE", path)

    async def __aenter__(self) -> AsyncWatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def watch_params(path: str, recursive: bool, include_entry: bool = False) -> Dict[str, Any]:
    params = {"path": path, "recursive": "1" if recursive else "0"}
    if include_entry:
        params["include_entry"] = "1"
    return params


__all__ = ["AsyncWatcher", "FileEvent", "Watcher", "watch_params"]
