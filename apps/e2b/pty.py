"""envd PTY processes on Hedgerow's PTY relay (``apps.sandboxes.services.pty``).

``Start`` with ``pty`` opens an agent terminal session and streams its output as
envd ``pty`` data events. Input, resizes and kills arrive as separate unary calls,
possibly on another web process: they are published on the session's Redis channel,
which the streaming request listens to. The session is bounded like any Hedgerow PTY
(per sandbox and per tenant, ``PtySlots``) and ends, with its processes, when the
stream does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

from apps.core.redis_sync import redis_client
from apps.e2b.connect import ConnectError, end_stream, envelope
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services.pty import (
    AgentEndpoint,
    PtyError,
    PtyRelay,
    PtySlots,
    pty_sandbox_limit,
    pty_tenant_limit,
)

KEEPALIVE_S = 20.0
SESSION_TTL_S = 86400


def sessions_key(sandbox: Sandbox) -> str:
    return f"{settings.REDIS_KEY_PREFIX}e2b:pty:{sandbox.pk.hex}:{sandbox.generation}"


def _size(pty: Any) -> tuple[int, int]:
    size = pty.get("size") if isinstance(pty, dict) else None
    rows = size.get("rows") if isinstance(size, dict) else None
    cols = size.get("cols") if isinstance(size, dict) else None
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1000 for v in (rows, cols)
    ):
        raise ConnectError("invalid_argument", "pty.size needs rows and cols from 1 to 1000")
    return int(rows), int(cols)  # type: ignore[arg-type]


def agent_init(data: dict[str, Any]) -> dict[str, Any]:
    """envd's StartRequest with ``pty`` → the agent's terminal init."""
    process = data.get("process")
    if not isinstance(process, dict) or not isinstance(process.get("cmd"), str):
        raise ConnectError("invalid_argument", "process.cmd is required")
    args = process.get("args") or []
    envs = process.get("envs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args must be strings")
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise ConnectError("invalid_argument", "process.envs must map strings to strings")
    cwd = process.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise ConnectError("invalid_argument", "process.cwd must be an absolute path")
    rows, cols = _size(data.get("pty"))
    return {
        "cmd": [process["cmd"], *args],
        "env": envs,
        "cwd": cwd,
        "rows": rows,
        "cols": cols,
        "login_shell": False,
    }


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return envelope({"event": {kind: body}})


async def pty_events(
    *, sandbox: Sandbox, init: dict[str, Any], limits: tuple[int, int]
) -> AsyncIterator[bytes]:
    """The terminal's stream: start (pid), output, keepalives, and its exit. Closing
    the stream (the client went away) ends the session and its processes."""
    client: aioredis.Redis = aioredis.Redis.from_url(settings.REDIS_URL)
    slots = PtySlots(client, tenant_id=str(sandbox.tenant_id), sandbox_pk=str(sandbox.pk))
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def on_output(data: bytes) -> None:
        await queue.put(("out", data))

    async def on_exit(code: int | None, error: str | None) -> None:
        await queue.put(("exit", (code, error)))

    relay = PtyRelay(AgentEndpoint.for_sandbox(sandbox), on_output, on_exit)
    pubsub = client.pubsub()
    listener: asyncio.Task[None] | None = None
    pid: int | None = None
    acquired = False
    try:
        full = await slots.acquire(sandbox_limit=limits[0], tenant_limit=limits[1])
        if full is not None:
            yield end_stream(
                ConnectError("resource_exhausted", f"too many terminals open for this {full}")
            )
            return
        acquired = True
        try:
            pid = await relay.start(init)
        except PtyError as exc:
            yield end_stream(ConnectError("unavailable", str(exc)))
            return
        channel = f"{settings.REDIS_KEY_PREFIX}e2b:ptyin:{uuid.uuid4().hex}"
        await pubsub.subscribe(channel)
        await client.hset(sessions_key(sandbox), str(pid), channel)  # type: ignore[misc]
        await client.expire(sessions_key(sandbox), SESSION_TTL_S)

        async def listen() -> None:
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    await queue.put(("ctl", message["data"]))

        listener = asyncio.create_task(listen())
        yield _event("start", {"pid": pid})
        while True:
            try:
                kind, value = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                with contextlib.suppress(Exception):
                    await slots.refresh()
                yield _event("keepalive", {})
                continue
            if kind == "out":
                yield _event("data", {"pty": base64.b64encode(value).decode()})
            elif kind == "ctl":
                await _control(relay, value)
            else:
                code, error = value
                if code is None:
                    yield end_stream(ConnectError("unavailable", error or "the terminal ended"))
                    return
                yield _event(
                    "end", {"exitCode": code, "exited": True, "status": f"exit status {code}"}
                )
                yield end_stream()
                return
    finally:
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener
        await relay.close()
        with contextlib.suppress(Exception):
            if pid is not None:
                await client.hdel(sessions_key(sandbox), str(pid))  # type: ignore[misc]
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            if acquired:
                await slots.release()
        with contextlib.suppress(Exception):
            await client.aclose()


async def _control(relay: PtyRelay, raw: bytes) -> None:
    """One published control message: input, a resize or a kill (already validated by
    the publisher; a broken one is dropped)."""
    try:
        message = json.loads(raw)
        if message["op"] == "input":
            await relay.write(base64.b64decode(message["data"], validate=True))
        elif message["op"] == "resize":
            await relay.resize(int(message["rows"]), int(message["cols"]))
        elif message["op"] == "kill":
            await relay.signal("KILL")
    except (ValueError, KeyError, TypeError, binascii.Error, PtyError):
        return


def pty_limits(sandbox: Sandbox) -> tuple[int, int]:
    return pty_sandbox_limit(sandbox), pty_tenant_limit(sandbox.tenant)


def pty_channel(*, sandbox: Sandbox, selector: Any) -> str | None:
    """The control channel of the sandbox's terminal with this pid, or None."""
    pid = selector.get("pid") if isinstance(selector, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise ConnectError("invalid_argument", "select the process by pid")
    raw: Any = redis_client().hget(sessions_key(sandbox), str(pid))
    return raw.decode() if raw else None


def pty_publish(*, channel: str, message: dict[str, Any]) -> None:
    """Sends a control message to the request streaming the terminal; not_found when
    nobody listens any more (the terminal ended)."""
    try:
        listeners = redis_client().publish(channel, json.dumps(message))
    except redis.RedisError as exc:
        raise ConnectError("unavailable", f"could not reach the terminal: {exc}") from exc
    if not listeners:
        raise ConnectError("not_found", "the terminal has ended")


def pty_input(data: Any) -> dict[str, Any]:
    """A ProcessInput → the control message (only ``pty`` input reaches a terminal)."""
    if not isinstance(data, dict) or not isinstance(data.get("pty"), str):
        raise ConnectError("unimplemented", "stdin for a running command is not supported yet")
    try:
        base64.b64decode(data["pty"], validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", "input.pty is not base64") from None
    return {"op": "input", "data": data["pty"]}


def pty_resize(pty: Any) -> dict[str, Any]:
    rows, cols = _size(pty)
    return {"op": "resize", "rows": rows, "cols": cols}
