"""Commands running in the background: ``sandbox.exec(cmd, background=True)`` returns a
handle at once (the command is already running) to wait for, kill, read the output of
as it is produced, or pick up again later by id (``sandbox.command(id)``), from this
process or another one."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, Iterator, Optional

from hedgerow import streaming
from hedgerow.errors import WaitTimeout
from hedgerow.results import ExecResult

if TYPE_CHECKING:
    from hedgerow.aio import AsyncSandbox
    from hedgerow.client import Sandbox

# How often ``wait`` re-reads the record: quickly at first (most commands are short),
# then at most once a second.
POLL_FIRST_S = 0.05
POLL_MAX_S = 1.0


def _next_poll(interval: float) -> float:
    return min(interval * 2, POLL_MAX_S)


def _timed_out(operation_id: str, timeout: Optional[float]) -> WaitTimeout:
    return WaitTimeout(
        f"command {operation_id} still running after {timeout} s; wait() again, or kill() it",
        code="wait_timeout",
    )


class CommandHandle:
    """A command running in a sandbox. ``id`` is its operation id (keep it to
    reconnect: ``sandbox.command(id)``). The command keeps running whatever this
    process does; only ``kill()``, its own timeout or the sandbox's end stop it."""

    def __init__(self, sandbox: Sandbox, data: Dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.data = data

    @property
    def id(self) -> str:
        """The command's operation id (``op-`` + 32 hex digits unless chosen)."""
        return str(self.data["id"])

    @property
    def running(self) -> bool:
        """As of the last read (``refresh()`` reads again)."""
        return str(self.data.get("status")) == "running"

    def __repr__(self) -> str:
        return f"<CommandHandle {self.id} {self.data.get('status')}>"

    def refresh(self) -> CommandHandle:
        """Re-reads the command's record (``running``, ``data``)."""
        path = f"/sandboxes/{self.sandbox.id}/operations/{self.id}"
        self.data = self.sandbox._client.request("GET", path).json()
        return self

    def wait(self, timeout: Optional[float] = None) -> ExecResult:
        """Blocks until the command ends and returns its typed result; ``timeout``
        (seconds, default none) raises ``WaitTimeout`` and leaves it running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = POLL_FIRST_S
        while self.running:
            if deadline is not None and time.monotonic() >= deadline:
                raise _timed_out(self.id, timeout)
            pause = interval if deadline is None else min(interval, deadline - time.monotonic())
            time.sleep(max(pause, 0.0))
            interval = _next_poll(interval)
            self.refresh()
        return ExecResult.from_api(self.data)

    def kill(self) -> ExecResult:
        """Kills the command (SIGTERM to its whole session, SIGKILL after its kill
        grace) and returns its result; killing an ended command returns its result
        unchanged."""
        path = f"/sandboxes/{self.sandbox.id}/operations/{self.id}/cancel"
        self.data = self.sandbox._client.request("POST", path).json()
        return self.wait()

    def output(self, *, after_seq: int = -1) -> Iterator[streaming.Frame]:
        """The command's frames (start, stdout, stderr, exit) from the beginning (or
        after ``after_seq``) as they are produced, over a websocket that resumes where
        it dropped; ends with the ``exit`` frame. Needs ``hedgerow[stream]``."""
        return streaming.stream_operation(
            self.sandbox._client.url,
            self.sandbox._client.api_key,
            self.sandbox.id,
            self.id,
            after_seq=after_seq,
        )

    def __iter__(self) -> Iterator[streaming.Frame]:
        return self.output()


class AsyncCommandHandle:
    """The asyncio twin of ``CommandHandle`` (``await handle.wait()``,
    ``async for frame in handle``)."""

    def __init__(self, sandbox: AsyncSandbox, data: Dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.data = data

    @property
    def id(self) -> str:
        """The command's operation id (``op-`` + 32 hex digits unless chosen)."""
        return str(self.data["id"])

    @property
    def running(self) -> bool:
        """As of the last read (``await refresh()`` reads again)."""
        return str(self.data.get("status")) == "running"

    def __repr__(self) -> str:
        return f"<AsyncCommandHandle {self.id} {self.data.get('status')}>"

    async def refresh(self) -> AsyncCommandHandle:
        """Re-reads the command's record (``running``, ``data``)."""
        path = f"/sandboxes/{self.sandbox.id}/operations/{self.id}"
        self.data = (await self.sandbox._client.request("GET", path)).json()
        return self

    async def wait(self, timeout: Optional[float] = None) -> ExecResult:
        """See ``CommandHandle.wait``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = POLL_FIRST_S
        while self.running:
            if deadline is not None and time.monotonic() >= deadline:
                raise _timed_out(self.id, timeout)
            pause = interval if deadline is None else min(interval, deadline - time.monotonic())
            await asyncio.sleep(max(pause, 0.0))
            interval = _next_poll(interval)
            await self.refresh()
        return ExecResult.from_api(self.data)

    async def kill(self) -> ExecResult:
        """See ``CommandHandle.kill``."""
        path = f"/sandboxes/{self.sandbox.id}/operations/{self.id}/cancel"
        self.data = (await self.sandbox._client.request("POST", path)).json()
        return await self.wait()

    def output(self, *, after_seq: int = -1) -> AsyncIterator[streaming.Frame]:
        """See ``CommandHandle.output``."""
        return streaming.astream_operation(
            self.sandbox._client.url,
            self.sandbox._client.api_key,
            self.sandbox.id,
            self.id,
            after_seq=after_seq,
        )

    def __aiter__(self) -> AsyncIterator[streaming.Frame]:
        return self.output()
