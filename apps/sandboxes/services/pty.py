"""PTY relay: one client connection ↔ one agent ``/pty`` upgraded connection.

``PtyRelay`` knows nothing about websockets: it takes the agent endpoint and two
async callables (output bytes, exit), so the Hedgerow websocket consumer and the
Orchard-compatible one share it. Closing the relay closes the agent connection,
and the agent then kills the session's process group (no reattach).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from apps.billing.limits import hot_limits  # the quota's PTY limit, cached per process
from apps.sandboxes.agent_client import agent_token
from apps.sandboxes.models import Sandbox
from apps.tenancy.models import Tenant

PROTOCOL = "hedgerow-pty/1"
_HEADER = struct.Struct(">cI")
MAX_FRAME = 1024 * 1024
SIGNALS = frozenset({"INT", "TERM", "KILL", "HUP", "QUIT", "TSTP", "CONT", "WINCH", "USR1", "USR2"})
SLOT_TTL_S = 60


class PtyError(Exception):
    """The agent refused or broke the session (message is safe to show)."""


@dataclass(frozen=True)
class AgentEndpoint:
    host: str
    port: int
    token: str

    @classmethod
    def for_sandbox(cls, sandbox: Sandbox) -> AgentEndpoint:
        assert sandbox.endpoint_port is not None
        return cls(
            sandbox.endpoint_host,
            sandbox.endpoint_port,
            agent_token(sandbox.id.hex, sandbox.generation),
        )


OnOutput = Callable[[bytes], Awaitable[None]]
OnExit = Callable[[int | None, str | None], Awaitable[None]]


class PtyRelay:
    """``await relay.start(init)`` → pid; then ``write``/``resize``/``signal``;
    ``on_output(bytes)`` gets terminal output, ``on_exit(code, error)`` is called once
    (code None with an error message when the agent failed). ``close()`` is idempotent."""

    def __init__(self, endpoint: AgentEndpoint, on_output: OnOutput, on_exit: OnExit) -> None:
        self.endpoint = endpoint
        self.on_output = on_output
        self.on_exit = on_exit
        self.pid: int | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._exited = False

    async def start(self, init: dict[str, Any], *, timeout: float = 10.0) -> int:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.endpoint.host, self.endpoint.port), timeout
            )
            self._reader, self._writer = reader, writer
            writer.write(
                (
                    "POST /pty HTTP/1.1\r\nHost: agent\r\n"
                    f"Authorization: Bearer {self.endpoint.token}\r\n"
                    f"Connection: Upgrade\r\nUpgrade: {PROTOCOL}\r\nContent-Length: 0\r\n\r\n"
                ).encode()
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            status = int(head.split(b" ", 2)[1])
            if status != 101:
                raise PtyError(_agent_refusal(status))
            self._send(b"I", json.dumps(init).encode())
            kind, payload = await asyncio.wait_for(self._recv(), timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            await self.close()
            raise PtyError(f"the sandbox's agent did not open a terminal: {exc!r}") from exc
        except PtyError:
            await self.close()
            raise
        if kind != b"P":
            await self.close()
            raise PtyError(_message(payload))
        self.pid = int(json.loads(payload)["pid"])
        self._task = asyncio.create_task(self._pump())
        return self.pid

    async def write(self, data: bytes) -> None:
        for i in range(0, len(data), MAX_FRAME):
            self._send(b"D", data[i : i + MAX_FRAME])
        await self._drain()

    async def resize(self, rows: int, cols: int) -> None:
        self._send(b"R", json.dumps({"rows": rows, "cols": cols}).encode())
        await self._drain()

    async def signal(self, name: str) -> None:
        if name not in SIGNALS:
            raise ValueError(f"unknown signal {name!r}")
        self._send(b"S", json.dumps({"sig": name}).encode())
        await self._drain()

    async def close(self) -> None:
        """Drops the agent connection; the agent SIGHUPs then SIGKILLs the session."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(OSError, RuntimeError):
                writer.write(_HEADER.pack(b"C", 0))
            writer.close()
            with contextlib.suppress(OSError, RuntimeError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 2)
        task = self._task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self._writer is None:
            raise PtyError("the terminal is closed")
        self._writer.write(_HEADER.pack(kind, len(payload)) + payload)

    async def _drain(self) -> None:
        if self._writer is not None:
            try:
                await self._writer.drain()
            except OSError as exc:
                raise PtyError("the terminal connection broke") from exc

    async def _recv(self) -> tuple[bytes, bytes]:
        assert self._reader is not None
        header = await self._reader.readexactly(_HEADER.size)
        kind, length = _HEADER.unpack(header)
        if length > MAX_FRAME:
            raise ValueError("agent frame too large")
        payload = await self._reader.readexactly(length) if length else b""
        return kind, payload

    async def _pump(self) -> None:
        code: int | None = None
        error: str | None = None
        try:
            while True:
                kind, payload = await self._recv()
                if kind == b"O":
                    await self.on_output(payload)
                elif kind == b"X":
                    code = int(json.loads(payload)["code"])
                    break
                elif kind == b"E":
                    # Bad frame reports keep the session; the relay validated them anyway.
                    continue
        except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as exc:
            error = f"the terminal connection broke: {exc!r}"
        if not self._exited:
            self._exited = True
            await self.on_exit(code, error)


def _agent_refusal(status: int) -> str:
    if status == 429:
        return "the sandbox has too many terminals open"
    if status == 401:
        return "the agent refused the sandbox's credentials"
    return f"the agent answered {status} to the terminal request"


def _message(payload: bytes) -> str:
    try:
        return str(json.loads(payload).get("message", "terminal failed"))
    except (ValueError, AttributeError):
        return "terminal failed"


# -- concurrency bounds ---------------------------------------------------------
def pty_tenant_limit(tenant: Tenant) -> int:
    """Concurrent PTY sessions a tenant may hold: its quota's ``max_pty_sessions`` when
    staff set one, else the installation default."""
    return hot_limits(str(tenant.pk)).max_pty or int(settings.HEDGEROW_PTY_MAX_PER_TENANT)


def pty_sandbox_limit(sandbox: Sandbox) -> int:
    return int(settings.HEDGEROW_PTY_MAX_PER_SANDBOX)


# Sorted sets of session ids scored by expiry; a session refreshes its slot while it
# runs, so a web process that dies frees its slots within SLOT_TTL_S.
_ACQUIRE = """
local now = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  if redis.call('ZCARD', KEYS[i]) >= tonumber(ARGV[3 + i]) then return i end
end
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now + tonumber(ARGV[2]), ARGV[3])
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[2]) * 2)
end
return 0
"""


class PtySlots:
    """Bounds concurrent sessions per sandbox and per tenant, across web processes."""

    def __init__(self, client: aioredis.Redis, *, tenant_id: str, sandbox_pk: str) -> None:
        prefix = settings.REDIS_KEY_PREFIX
        self.client = client
        self.keys = [
            f"{prefix}pty:sandbox:{sandbox_pk}",
            f"{prefix}pty:tenant:{tenant_id}",
            f"{prefix}pty:installation",
        ]
        self.session_id = uuid.uuid4().hex

    async def acquire(self, *, sandbox_limit: int, tenant_limit: int) -> str | None:
        """None when a slot was taken, else which bound is full (``sandbox``, ``tenant``
        or ``installation``: HEDGEROW_PTY_MAX_PER_INSTALLATION, 0 = unlimited)."""
        installation_limit = int(settings.HEDGEROW_PTY_MAX_PER_INSTALLATION) or 2**31
        full = await self.client.eval(  # type: ignore[misc]
            _ACQUIRE,
            len(self.keys),
            *self.keys,
            str(time.time()),
            str(SLOT_TTL_S),
            self.session_id,
            str(sandbox_limit),
            str(tenant_limit),
            str(installation_limit),
        )
        return None if int(full) == 0 else ("sandbox", "tenant", "installation")[int(full) - 1]

    async def refresh(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.zadd(key, {self.session_id: time.time() + SLOT_TTL_S}, xx=True)
        await pipe.execute()

    async def release(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.zrem(key, self.session_id)
        await pipe.execute()
