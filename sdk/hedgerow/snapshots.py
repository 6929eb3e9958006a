"""Snapshots and forks (docs/snapshots.md): ``sb.snapshot()``, ``client.fork()``."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Union, cast

from hedgerow.errors import SnapshotFailed, WaitTimeout
from hedgerow.shapes import Fingerprint, SnapshotData

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


def raise_if_failed(data: Mapping[str, Any]) -> None:
    if data.get("state") == "failed":
        err = data.get("error") or {}
        raise SnapshotFailed(
            str(err.get("message", "the capture failed")),
            code=str(err.get("code", "snapshot_failed")),
            body=dict(data),
        )


class _SnapshotData:
    data: SnapshotData  # the server's JSON as last read

    @property
    def id(self) -> str:
        """The snapshot's id."""
        return str(self.data["id"])

    @property
    def state(self) -> str:
        """``capturing``, ``ready``, ``failed`` or ``deleted`` (as last read)."""
        return str(self.data["state"])

    @property
    def fingerprint(self) -> Fingerprint:
        """What a fork is checked against (docs/snapshots.md, Fingerprints): tree hash
        and file count, probe results, listening ports, processes, environment."""
        return cast(Fingerprint, dict(self.data.get("fingerprint") or {}))

    @property
    def manifest(self) -> Dict[str, Any]:
        """The manifest given at capture: the caller's own JSON object, as given."""
        return dict(self.data.get("manifest") or {})


class Snapshot(_SnapshotData):
    """A captured sandbox state: ``fingerprint``, ``manifest``, sizes; ``fork(n)``."""

    def __init__(self, client: Client, data: SnapshotData) -> None:
        self._client = client
        self.data = data

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} {self.state}>"

    def refresh(self) -> Snapshot:
        """Reads the snapshot again (``data``, ``state``)."""
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
        """Deletes the snapshot (its stored state; forks already made are kept)."""
        self.data = self._client.request("DELETE", f"/snapshots/{self.id}").json()

    def fork(self, n: int = 8, **kwargs: Any) -> List[Sandbox]:
        """``n`` new sandboxes from this state (default 8): ``client.fork``."""
        return self._client.fork(self, n, **kwargs)


class AsyncSnapshot(_SnapshotData):
    """``Snapshot`` for ``AsyncClient``."""

    def __init__(self, client: AsyncClient, data: SnapshotData) -> None:
        self._client = client
        self.data = data

    def __repr__(self) -> str:
        return f"<AsyncSnapshot {self.id} {self.state}>"

    async def refresh(self) -> AsyncSnapshot:
        """See ``Snapshot.refresh``."""
        self.data = (await self._client.request("GET", f"/snapshots/{self.id}")).json()
        return self

    async def wait(self, timeout: float = 300.0, *, poll: float = 0.2) -> AsyncSnapshot:
        """See ``Snapshot.wait`` (``timeout`` and ``poll`` in seconds)."""
        deadline = time.monotonic() + timeout
        while self.state == "capturing":
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"snapshot {self.id} still capturing", code="wait_timeout")
            await asyncio.sleep(poll)
            await self.refresh()
        raise_if_failed(self.data)
        return self

    async def delete(self) -> None:
        """See ``Snapshot.delete``."""
        self.data = (await self._client.request("DELETE", f"/snapshots/{self.id}")).json()

    async def fork(self, n: int = 8, **kwargs: Any) -> List[AsyncSandbox]:
        """See ``Snapshot.fork``."""
        return await self._client.fork(self, n, **kwargs)


SnapshotRef = Union[Snapshot, AsyncSnapshot, str]


def snapshot_id(ref: SnapshotRef) -> str:
    return ref.id if isinstance(ref, _SnapshotData) else str(ref)
