"""``/ws/v1/sandboxes/<id>/pty``: an interactive terminal relayed to the agent."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from typing import Any

from django.conf import settings

from apps.core.asyncdb import db_async
from apps.core.errors import ApiError
from apps.sandboxes import selectors
from apps.sandboxes.consumers.base import BadFrame, HedgerowConsumer
from apps.sandboxes.consumers.feeds import new_redis
from apps.sandboxes.services.operations import ensure_ready
from apps.sandboxes.services.pty import (
    SIGNALS,
    SLOT_TTL_S,
    AgentEndpoint,
    PtyError,
    PtyRelay,
    PtySlots,
    pty_sandbox_limit,
    pty_tenant_limit,
)
from apps.tenancy.principal import Principal

INIT_TIMEOUT_S = 10.0
MAX_STDIN_FRAME = 64 * 1024


@db_async
def _sandbox_target(principal: Principal, sandbox_id: str) -> tuple[AgentEndpoint, str, int, int]:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    ensure_ready(sandbox)
    return (
        AgentEndpoint.for_sandbox(sandbox),
        str(sandbox.pk),
        pty_sandbox_limit(sandbox),
        pty_tenant_limit(principal.tenant),
    )


def _size(message: dict[str, Any], name: str, default: int) -> int:
    value = message.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise BadFrame(f"{name} must be an integer from 1 to 1000", name)
    return int(value)


def _init(message: dict[str, Any]) -> dict[str, Any]:
    cmd = message.get("cmd")
    if cmd is not None and not (
        (isinstance(cmd, str) and cmd)
        or (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd))
    ):
        raise BadFrame("cmd must be null, a string or a list of strings", "cmd")
    env = message.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise BadFrame("env must map names to strings", "env")
    cwd = message.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise BadFrame("cwd must be a string", "cwd")
    return {
        "cmd": cmd,
        "env": env,
        "cwd": cwd,
        "rows": _size(message, "rows", 24),
        "cols": _size(message, "cols", 80),
        "login_shell": bool(message.get("login_shell", False)),
    }


class PtyConsumer(HedgerowConsumer):
    max_frame = MAX_STDIN_FRAME + 1024

    async def on_connect(self) -> None:
        self.relay: PtyRelay | None = None
        self.slots: PtySlots | None = None
        self.tasks: list[asyncio.Task[None]] = []
        if not self.principal.has_scope("write"):
            await self.fail(
                "permission_denied", "a terminal needs the write scope", close_code=4403
            )
            return
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        try:
            endpoint, sandbox_pk, sandbox_limit, tenant_limit = await _sandbox_target(
                self.principal, sandbox_id
            )
        except ApiError as exc:
            close = 4404 if exc.status_code == 404 else 4409
            await self.fail(exc.code, exc.message, close_code=close)
            return
        self.redis = new_redis()
        self.slots = PtySlots(
            self.redis, tenant_id=str(self.principal.tenant.pk), sandbox_pk=sandbox_pk
        )
        full = await self.slots.acquire(sandbox_limit=sandbox_limit, tenant_limit=tenant_limit)
        if full is not None:
            self.slots = None
            limit = {
                "sandbox": sandbox_limit,
                "tenant": tenant_limit,
                "installation": settings.HEDGEROW_PTY_MAX_PER_INSTALLATION,
            }[full]
            await self.fail(
                "pty_limit",
                f"at most {limit} terminals per {full} at once",
                close_code=4409,
                limit=limit,
            )
            return
        self.endpoint = endpoint
        self.tasks.append(asyncio.create_task(self._init_deadline()))
        self.tasks.append(asyncio.create_task(self._keep_slot()))

    async def _init_deadline(self) -> None:
        await asyncio.sleep(INIT_TIMEOUT_S)
        if self.relay is None and not self.closed:
            await self.fail("bad_frame", "send pty.init first", close_code=4400)

    async def _keep_slot(self) -> None:
        while not self.closed and self.slots is not None:
            await asyncio.sleep(SLOT_TTL_S / 3)
            with contextlib.suppress(Exception):
                await self.slots.refresh()

    async def on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if self.relay is None:
            if kind != "pty.init":
                raise BadFrame("the first frame must be pty.init", "type")
            await self._start(_init(message))
            return
        if kind == "pty.stdin":
            data = message.get("data")
            if not isinstance(data, str):
                raise BadFrame("data must be base64", "data")
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise BadFrame("data must be base64", "data") from None
            await self._write(raw)
        elif kind == "pty.resize":
            await self._guard(
                self.relay.resize(_size(message, "rows", 0), _size(message, "cols", 0))
            )
        elif kind == "pty.signal":
            name = str(message.get("signal", "")).upper().removeprefix("SIG")
            if name not in SIGNALS:
                raise BadFrame(f"signal must be one of {', '.join(sorted(SIGNALS))}", "signal")
            await self._guard(self.relay.signal(name))
        elif kind == "pty.close":
            await self.close_with(1000)
            await self._teardown()
        elif kind == "pty.init":
            raise BadFrame("the terminal is already started", "type")
        else:
            raise BadFrame(f"unknown frame type {kind!r}", "type")

    async def on_binary(self, data: bytes) -> None:
        if self.relay is None:
            raise BadFrame("the first frame must be pty.init")
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        assert self.relay is not None
        await self._guard(self.relay.write(data))

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except PtyError as exc:
            await self.fail("agent_unreachable", str(exc), close_code=4502)
            await self._teardown()

    async def _start(self, init: dict[str, Any]) -> None:
        self.relay = PtyRelay(self.endpoint, self._on_output, self._on_exit)
        try:
            pid = await self.relay.start(init)
        except PtyError as exc:
            await self.fail("agent_unreachable", str(exc), close_code=4502)
            await self._teardown()
            return
        await self.send_json({"type": "pty.ready", "pid": pid})

    async def _on_output(self, data: bytes) -> None:
        if not self.closed:
            await self.send(bytes_data=data)

    async def _on_exit(self, code: int | None, error: str | None) -> None:
        if error is not None and code is None:
            await self.fail("agent_unreachable", error, close_code=4502)
        else:
            await self.send_json({"type": "pty.exit", "code": code})
            await self.close_with(1000)
        await self._teardown()

    async def _teardown(self) -> None:
        relay, self.relay = self.relay, None
        if relay is not None:
            await relay.close()
            # A placeholder keeps later frames from looking like a missing init.
            self.relay = relay
        slots, self.slots = getattr(self, "slots", None), None
        if slots is not None:
            with contextlib.suppress(Exception):
                await slots.release()

    async def on_credential_lost(self) -> None:
        await self._teardown()  # ends the agent session: its processes are killed

    async def disconnect(self, code: int) -> None:
        self.closed = True
        for task in getattr(self, "tasks", []):
            if task is not asyncio.current_task():
                task.cancel()
        await self._teardown()
        redis = getattr(self, "redis", None)
        if redis is not None:
            await redis.aclose()
