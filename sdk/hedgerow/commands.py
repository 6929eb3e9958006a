"""Commands running in the background: ``sandbox.exec(cmd, background=True)`` returns a
handle at once (the command is already running) to wait for, kill, read the output of
as it is produced, or pick up again later by id (``sandbox.command(id)``), from this
process or another one."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, Iterator, Optional, Union

from hedgerow import streaming
from hedgerow.errors import Conflict, WaitTimeout
from hedgerow.results import ExecResult

if TYPE_CHECKING:
    from hedgerow.aio import AsyncSandbox
    from hedgerow.client import Sandbox

# How often ``wait`` re-reads the record: quickly at first (most commands are short),
# then at most once a second.
POLL_FIRST_S = 0.05
POLL_MAX_S = 1.0


STDIN_CHUNK = 1024 * 1024  # the server's largest write


def stdin_body(chunk: bytes, *, eof: bool, offset: Optional[int]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"data": base64.b64encode(chunk).decode("ascii"), "eof": eof}
    if offset is not None:
        body["offset"] = offset
    return body


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
        # Where the command's input stands (None: not known yet, e.g. a handle picked
        # up by id; learned from the first answer). Sent with each write, it makes a
        # retried write safe: the agent never writes the same bytes twice.
        self._stdin_offset: Optional[int] = None

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

    def send_stdin(self, data: Union[bytes, str], *, eof: bool = False) -> int:
        """Writes ``data`` (bytes, or text sent as UTF-8) to the command's stdin, in
        order, and returns how many bytes were taken; ``eof=True`` closes its stdin
        after them. Needs ``exec(..., background=True, stdin_open=True)``. Up to 1 MiB
        the command has not read yet is held for it; past that the call waits and
        retries (429 ``stdin_full``, then ``QuotaExceeded`` after the retries).
        ``Conflict`` (``stdin_closed``) when the command takes no more input: EOF was
        sent, it closed its stdin, or it ended. Writes larger than 1 MiB go in 1 MiB
        calls. Retries never write twice (each carries its offset)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        path = f"/sandboxes/{self.sandbox.id}/operations/{self.id}/stdin"
        chunks = [raw[i : i + STDIN_CHUNK] for i in range(0, len(raw), STDIN_CHUNK)] or [b""]
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            body = stdin_body(chunk, eof=eof and last, offset=self._stdin_offset)
            try:
                answer = self.sandbox._client.request(
                    "POST", path, json=body, retry=self._stdin_offset is not None
                ).json()
            except Conflict as exc:
                if exc.code != "stdin_offset":
                    raise
                # Another writer moved the input on; this chunk was not written. Send
                # it where the input stands now (learned from the answer).
                body.pop("offset")
                answer = self.sandbox._client.request("POST", path, json=body, retry=False).json()
            self._stdin_offset = int(answer["offset"])
        return len(raw)

    def close_stdin(self) -> None:
        """Closes the command's stdin (EOF) once what was sent is written. Closing
        again, or closing the stdin of a command that ended, does nothing."""
        try:
            self.send_stdin(b"", eof=True)
        except Conflict as exc:
            if exc.code != "stdin_closed":
                raise

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
        self._stdin_offset: Optional[int] = None  # see CommandHandle

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

    async def send_stdin(self, data: Union[bytes, str], *, eof: bool = False) -> int:
        """See ``CommandHandle.send_stdin``."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        path = f"/sandboxes/{self.sandbox.id}/operations/{self.id}/stdin"
        chunks = [raw[i : i + STDIN_CHUNK] for i in range(0, len(raw), STDIN_CHUNK)] or [b""]
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            body = stdin_body(chunk, eof=eof and last, offset=self._stdin_offset)
            try:
                answer = (
                    await self.sandbox._client.request(
                        "POST", path, json=body, retry=self._stdin_offset is not None
                    )
                ).json()
            except Conflict as exc:
                if exc.code != "stdin_offset":
                    raise
                body.pop("offset")  # see CommandHandle.send_stdin
                answer = (
                    await self.sandbox._client.request("POST", path, json=body, retry=False)
                ).json()
            self._stdin_offset = int(answer["offset"])
        return len(raw)

    async def close_stdin(self) -> None:
        """See ``CommandHandle.close_stdin``."""
        try:
            await self.send_stdin(b"", eof=True)
        except Conflict as exc:
            if exc.code != "stdin_closed":
                raise

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
