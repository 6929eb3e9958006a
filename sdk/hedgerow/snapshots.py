"""Snapshots and forks (docs/snapshots.md): ``sb.snapshot()``, ``client.fork()``."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from hedgerow.errors import SnapshotFailed, WaitTimeout

if TYPE_CHECKING:
    from hedgerow.aio import AsyncClient, AsyncSandbox
    from hedgerow.client import Client, Sandbox


def snapshot_body(
    *,
    name: Optional[str],
    manifest: Optional[Dict[str, Any]],
    probes: Optional[List[Dict[str, Any]]],
    ttl_seconds: Optional[int],
    volatile: Optional[List[str]] = None,
) -> Dict[str, Any]:
    optional = {
        "name": name,
        "manifest": manifest,
        "probes": probes,
        "ttl_seconds": ttl_seconds,
        "volatile": volatile,
    }
    return {k: v for k, v in optional.items() if v is not None}


def raise_if_failed(data: Dict[str, Any]) -> None:
    if data.get("state") == "failed":
        err = data.get("error") or {}
        raise SnapshotFailed(
            str(err.get("message", "the capture failed")),
            code=str(err.get("code", "snapshot_failed")),
            body=data,
        )


class _SnapshotData:
    data: Dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> str:
        return str(self.data["state"])

    @property
    def fingerprint(self) -> Dict[str, Any]:
        return dict(self.data.get("fingerprint") or {})

    @property
    def manifest(self) -> Dict[str, Any]:
        return dict(self.data.get("manifest") or {})


class Snapshot(_SnapshotData):
    """A captured sandbox state: ``fingerprint``, ``manifest``, sizes; ``fork(n)``."""

    def __init__(self, client: Client, data: Dict[str, Any]) -> None:
        self._client = client
        self.data = data

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} {self.state}>"

    def refresh(self) -> Snapshot:
        self.data = self._client.request("GET", f"/snapshots/{self.id}").json()
        return self

    def wait(self, timeout: float = 300.0, *, poll: float = 0.2) -> Snapshot:
        """Until ``ready``; raises ``SnapshotFailed`` (its ``code`` says why) or
        ``WaitTimeout``."""
        deadline = time.monotonic() + timeout
        while self.state == "capturing":
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"snapshot {self.id} still capturing", code="wait_timeout")
            time.sleep(poll)
            self.refresh()
        raise_if_failed(self.data)
        return self

    def delete(self) -> None:
        self.data = self._client.request("DELETE", f"/snapshots/{self.id}").json()

    def fork(self, n: int = 8, **kwargs: Any) -> List[Sandbox]:
        return self._client.fork(self, n, **kwargs)


class AsyncSnapshot(_SnapshotData):
    """``Snapshot`` for ``AsyncClient``."""

    def __init__(self, client: AsyncClient, data: Dict[str, Any]) -> None:
        self._client = client
        self.data = data

    def __repr__(self) -> str:
        return f"<AsyncSnapshot {self.id} {self.state}>"

    async def refresh(self) -> AsyncSnapshot:
        self.data = (await self._client.request("GET", f"/snapshots/{self.id}")).json()
        return self

    async def wait(self, timeout: float = 300.0, *, poll: float = 0.2) -> AsyncSnapshot:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state == "capturing":
            if loop.time() >= deadline:
                raise WaitTimeout(f"snapshot {self.id} still capturing", code="wait_timeout")
            await asyncio.sleep(poll)
            await self.refresh()
        raise_if_failed(self.data)
        return self

    async def delete(self) -> None:
        self.data = (await self._client.request("DELETE", f"/snapshots/{self.id}")).json()

    async def fork(self, n: int = 8, **kwargs: Any) -> List[AsyncSandbox]:
        return await self._client.fork(self, n, **kwargs)


SnapshotRef = Union[Snapshot, AsyncSnapshot, str]


def snapshot_id(ref: SnapshotRef) -> str:
    return ref.id if isinstance(ref, _SnapshotData) else str(ref)
