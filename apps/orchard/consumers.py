"""Orchard's PTY websocket: ``/orchard/sandboxes/{id}/exec/pty?api_key=KEY``.

Only the frame translation lives here; the agent connection, its framing and the
per-sandbox / per-tenant session bounds are Hedgerow's ``PtyRelay`` and ``PtySlots``.
The key arrives in the query string (the Orchard SDK has no other way): it is read
here only and never logged — log lines name the sandbox, not the URL.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from typing import Any
from urllib.parse import parse_qs

import redis.asyncio as aioredis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from rest_framework.exceptions import AuthenticationFailed

from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.pty import (
    SIGNALS,
    AgentEndpoint,
    PtyError,
    PtyRelay,
    PtySlots,
    pty_sandbox_limit,
    pty_tenant_limit,
)
from apps.tenancy.auth import principal_for_key
from apps.tenancy.principal import Principal
from apps.tenancy.revalidate import Lost, watch_principal

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 10.0
SLOT_REFRESH_S = 20.0
MAX_FRAME = 1024 * 1024
CLOSE_AUTH, CLOSE_NOT_FOUND, CLOSE_NOT_READY, CLOSE_AGENT = 4401, 4404, 4409, 4503
CLOSE_BAD_FRAME, CLOSE_TOO_MANY = 4400, 4429


@database_sync_to_async  # type: ignore[misc]
def _principal(secret: str) -> Principal:
    return principal_for_key(secret)


@database_sync_to_async  # type: ignore[misc]
def _sandbox(principal: Principal, sandbox_id: str) -> tuple[Sandbox, int, int] | None:
    """The tenant's sandbox and its PTY bounds (the limits read quotas: the database)."""
    sandbox = (
        Sandbox.objects.for_tenant(principal.tenant)
        .select_related("tenant")
        .filter(external_id=sandbox_id)
        .first()
    )
    if sandbox is None:
        return None
    return sandbox, pty_sandbox_limit(sandbox), pty_tenant_limit(sandbox.tenant)


def _redis() -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(settings.REDIS_URL)
    return client


class OrchardPtyConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]
    relay: PtyRelay | None = None
    slots: PtySlots | None = None
    redis: aioredis.Redis | None = None

    async def connect(self) -> None:
        self.done = False
        self.relay = None
        self._tasks: list[asyncio.Task[None]] = []
        self._init_received = asyncio.Event()
        await self.accept()
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        secret = (query.get("api_key") or [""])[0].strip()
        if not secret:
            await self._fail("missing api_key", CLOSE_AUTH)
            return
        try:
            principal = await _principal(secret)
        except AuthenticationFailed:
            await self._fail("invalid API key", CLOSE_AUTH)
            return
        if not principal.has_scope("write"):
            await self._fail("this key may not open terminals", CLOSE_AUTH)
            return
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        found = await _sandbox(principal, sandbox_id)
        sandbox = found[0] if found is not None else None
        if found is None or sandbox is None or sandbox.state == State.DELETED:
            await self._fail(f"no sandbox {sandbox_id!r}", CLOSE_NOT_FOUND)
            return
        if sandbox.state != State.READY or sandbox.endpoint_port is None:
            await self._fail(f"sandbox {sandbox_id} is {sandbox.state}", CLOSE_NOT_READY)
            return
        self.sandbox = sandbox
        self.limits = found[1], found[2]
        self.principal = principal
        self._tasks.append(asyncio.create_task(self._init_deadline()))
        # A key revoked (or expired, or its team disabled) while the terminal is open
        # closes it within HEDGEROW_WS_REVALIDATE_S (docs/realtime.md).
        self._tasks.append(
            asyncio.create_task(
                watch_principal(principal, None, closed=lambda: self.done, on_lost=self._lost)
            )
        )

    async def _lost(self, lost: Lost) -> None:
        await self._send({"type": "error", "code": lost.code, "message": lost.message})
        await self._finish(lost.close_code)

    async def _init_deadline(self) -> None:
        try:
            await asyncio.wait_for(self._init_received.wait(), INIT_TIMEOUT_S)
        except TimeoutError:
            await self._fail("no init frame within 10 s", CLOSE_BAD_FRAME)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.done:
            return
        raw = text_data if text_data is not None else (bytes_data or b"").decode("utf-8", "replace")
        if len(raw) > MAX_FRAME:
            await self._fail("frame too large", CLOSE_BAD_FRAME)
            return
        try:
            frame = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested past the stack
            frame = None
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            await self._error("frames are JSON objects with a 'type'")
            return
        kind = frame["type"]
        if self.relay is None:
            if kind != "init":
                await self._fail("the first frame must be init", CLOSE_BAD_FRAME)
                return
            try:
                await self._start(frame)
            except Exception:
                log.exception("orchard pty start failed")
                await self._fail("internal error", 4500)
            return
        try:
            if kind == "stdin":
                await self.relay.write(base64.b64decode(str(frame.get("data", "")), validate=True))
            elif kind == "resize":
                rows, cols = int(frame["rows"]), int(frame["cols"])
                if not (0 < rows <= 1000 and 0 < cols <= 1000):
                    raise ValueError("rows and cols are 1-1000")
                await self.relay.resize(rows, cols)
            elif kind == "signal":
                sig = str(frame.get("sig", "")).upper().removeprefix("SIG")
                if sig not in SIGNALS:
                    raise ValueError(f"unknown signal {sig!r}")
                await self.relay.signal(sig)
            elif kind == "close":
                await self._finish(None)
            else:
                await self._error(f"unknown frame type {kind!r}")
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            await self._error(f"bad {kind} frame: {exc}")
        except PtyError as exc:
            await self._fail(str(exc), CLOSE_AGENT)

    async def _start(self, init: dict[str, Any]) -> None:
        self._init_received.set()
        cmd = init.get("cmd")
        if cmd is not None and not (
            isinstance(cmd, str)
            or (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd))
        ):
            await self._fail("cmd must be null, a string or a list of strings", CLOSE_BAD_FRAME)
            return
        agent_init = {
            "cmd": cmd,
            "env": init.get("env") or {},
            "cwd": init.get("cwd"),
            "rows": int(init.get("rows") or 24),
            "cols": int(init.get("cols") or 80),
            "login_shell": bool(init.get("login_shell", False)),
        }
        self.redis = _redis()
        self.slots = PtySlots(
            self.redis, tenant_id=str(self.sandbox.tenant_id), sandbox_pk=str(self.sandbox.pk)
        )
        full = await self.slots.acquire(sandbox_limit=self.limits[0], tenant_limit=self.limits[1])
        if full is not None:
            self.slots = None
            await self._fail(f"too many terminals open for this {full}", CLOSE_TOO_MANY)
            return
        relay = PtyRelay(AgentEndpoint.for_sandbox(self.sandbox), self._output, self._exited)
        self.relay = relay
        try:
            pid = await relay.start(agent_init)
        except PtyError as exc:
            await self._fail(str(exc), CLOSE_AGENT)
            return
        await self._send({"type": "ready", "pid": pid})
        self._tasks.append(asyncio.create_task(self._refresh_slots()))
        log.info("orchard pty opened", extra={"sandbox_id": str(self.sandbox.pk)})

    async def _refresh_slots(self) -> None:
        while not self.done and self.slots is not None:
            await asyncio.sleep(SLOT_REFRESH_S)
            with contextlib.suppress(Exception):
                await self.slots.refresh()

    async def _output(self, data: bytes) -> None:
        await self._send({"type": "stdout", "data": base64.b64encode(data).decode()})

    async def _exited(self, code: int | None, error: str | None) -> None:
        if error is not None or code is None:
            await self._send({"type": "error", "message": error or "the terminal ended"})
            await self._finish(CLOSE_AGENT)
        else:
            await self._send({"type": "exit", "code": code})
            await self._finish(1000)

    async def _send(self, frame: dict[str, Any]) -> None:
        if not self.done:
            await self.send(text_data=json.dumps(frame, separators=(",", ":")))

    async def _error(self, message: str) -> None:
        await self._send({"type": "error", "message": message})

    async def _fail(self, message: str, close_code: int) -> None:
        await self._error(message)
        await self._finish(close_code)

    async def _finish(self, close_code: int | None) -> None:
        """Idempotent: ends the agent session (which kills its processes), frees the
        slot, and closes the socket (``None`` = the client asked to close)."""
        if self.done:
            return
        self.done = True
        await self._release()
        await self.close(code=close_code or 1000)

    async def _release(self) -> None:
        relay, self.relay = self.relay, None
        if relay is not None:
            await relay.close()
        slots, self.slots = self.slots, None
        if slots is not None:
            with contextlib.suppress(Exception):
                await slots.release()
        client, self.redis = self.redis, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def disconnect(self, code: int) -> None:
        # A client that goes away must not leave its process running.
        self.done = True
        await self._release()
