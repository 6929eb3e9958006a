"""envd's ``process.Process/Start`` on the event loop, in front of Django.

The E2B SDK's ``commands.run`` is a Connect server stream: the regular view
(``envd.process_rpc``) is a sync Django view that records the operation through the
ORM and then reads the command's frames back from the replay buffer with a blocking
``XREAD``, one thread hop per chunk. Here the same command starts through the one
async exec core (``operation_exec_stream_async``: admission and the ``running`` row in
one round trip, the relay task that ``operation_exec_stream`` starts) and its frames
come straight from that relay as it stores them (``stream_pump.listen``): no thread
hop, no ORM, no polling. The relay still fills the replay buffer and records the end,
so reconnects (``Connect`` by pid), ``List``, kills, websockets and recovery see
exactly what they see for the regular path.

Everything this path does not handle exactly goes to Django unchanged (the body is
replayed): a terminal (``pty``), a token whose key or sandbox envVars this process has
not cached yet (the regular path caches both), a missing scope, a body or process
config the strict checks refuse (Django then gives the typed error), a disallowed
Host, and whatever ``operation_exec_stream_async`` returns FALLBACK for (refused
admission, a sandbox that is not ready or not the token's, trouble).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import signing
from django.db import close_old_connections
from django.http.request import split_domain_port, validate_host

from apps.core.asgi_body import Receive, Scope, Send, read_body, replay
from apps.core.errors import ApiError
from apps.core.logging import request_id_var
from apps.e2b import connect, stream_input
from apps.e2b.process import KEEPALIVE_S, end_events, exec_request, pids_key_of
from apps.e2b.services import sandbox_env_cached
from apps.e2b.tokens import SALT
from apps.sandboxes.models import Operation
from apps.sandboxes.services import stream_pump
from apps.sandboxes.services.exec_async import (
    StreamStarted,
    operation_exec_stream_async,
    single_flight,
)
from apps.sandboxes.services.replay import frames_key
from apps.tenancy.auth import principal_cached_for_key_id, principal_refresh_for_key_id

ASGIApp = Callable[..., Awaitable[None]]

log = logging.getLogger(__name__)
access_log = logging.getLogger("hedgerow.access")

PATH = "/e2b/envd/process.Process/Start"
MAX_BODY = 256 * 1024
PID_TTL_S = 86400
_WANTED = {b"x-access-token", b"e2b-sandbox-id", b"content-type", b"connect-timeout-ms", b"host"}
_HEADERS = [
    (b"content-type", connect.STREAM_CONTENT_TYPE.encode()),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
]


class EnvdStartFastPath:
    """ASGI middleware: plain envd command starts here, and StreamInput calls
    (``stream_input.serve``), everything else to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope.get("path") == stream_input.PATH
            and await stream_input.serve(scope, receive, send)
        ):
            return  # StreamInput, chunk by chunk (apps/e2b/stream_input.py)
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") != PATH
            or scope.get("query_string")
            or not settings.HEDGEROW_EXEC_FAST_PATH
        ):
            await self.app(scope, receive, send)
            return
        body, complete = await read_body(receive, MAX_BODY)
        started = time.perf_counter()
        request_id = uuid.uuid4().hex
        begun = await _start(scope, body) if complete else None
        if begun is None:
            await self.app(scope, replay(body, complete, receive), send)
            return
        stream, timeout = begun
        token = request_id_var.set(request_id)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [*_HEADERS, (b"x-request-id", request_id.encode())],
                }
            )
            async for chunk in _events(stream, timeout):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away; the relay goes on (a reconnect replays it)
        finally:
            stream_pump.unlisten(stream.operation_pk)
            request_id_var.reset(token)
        _log_access(200, request_id, started, stream.operation_id)


async def _start(scope: Scope, body: bytes) -> tuple[StreamStarted, float | None] | None:
    """The started command (and its timeout), or None for Django to answer."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            if name in headers:
                return None
            headers[name] = value
    if headers.get(b"content-type", b"").split(b";")[0].strip() != b"application/connect+json":
        return None
    if settings.ALLOWED_HOSTS != ["*"]:
        domain, _port = split_domain_port(headers.get(b"host", b"").decode("latin-1"))
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return None
    sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
    if not sandbox_id:
        return None
    try:
        claims = signing.loads(headers.get(b"x-access-token", b"").decode("latin-1"), salt=SALT)
        key_id, sandbox_pk = str(claims["k"]), uuid.UUID(str(claims["s"]))
    except (signing.BadSignature, KeyError, TypeError, ValueError):
        return None
    principal = principal_cached_for_key_id(key_id)
    if principal is None:  # stale: looked up again once for every start waiting on it
        try:
            principal = await single_flight(f"keyid:{key_id}", principal_refresh_for_key_id, key_id)
        except Exception:  # noqa: BLE001 - the regular path answers (and reports) it
            return None
    if principal is None or not principal.has_scope("write"):
        return None
    env = sandbox_env_cached(str(sandbox_pk))
    if env is None:
        return None
    data = _message(body)
    if data is None or data.get("pty") or not isinstance(data.get("stdin", False), bool):
        return None
    try:
        timeout = connect.timeout_s(_Headers(headers))  # type: ignore[arg-type]
        request = exec_request(
            data.get("process"),
            timeout=timeout,
            base_env=env,
            stdin_open=bool(data.get("stdin", False)),
        )
    except ApiError:
        return None  # Django gives the typed error
    try:
        stream = await operation_exec_stream_async(
            principal=principal,
            sandbox_external_id=sandbox_id,
            request=request,
            operation_id=f"e2b-{uuid.uuid4().hex}",
            sandbox_pk=sandbox_pk,
        )
    except Exception:  # noqa: BLE001 - the regular path answers (and reports) it
        log.warning("envd fast path: start failed", exc_info=True)
        return None
    return None if stream is None else (stream, request.timeout)


class _Headers:
    """What ``connect.timeout_s`` reads from a request: ``.headers.get``."""

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        value = raw.get(b"connect-timeout-ms", b"").decode("latin-1")
        self.headers = {"Connect-Timeout-Ms": value} if value else {}


def _message(body: bytes) -> dict[str, Any] | None:
    """The one envelope of a server-stream request, or None when it is not plain."""
    if len(body) < 5:
        return None
    flags, length = struct.unpack(">BI", body[:5])
    if flags or len(body) != 5 + length:
        return None
    try:
        data = json.loads(body[5:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return connect.envelope({"event": {kind: body}})


async def _events(stream: StreamStarted, timeout: float | None) -> AsyncIterator[bytes]:
    """start (with the pid), data as it comes, keepalives in silences, then the end and
    the end of the stream: what ``process.process_events`` sends, from the relay."""
    started = False
    last_seq = -1
    redis = stream_pump.redis_client_async()
    while True:
        try:
            item = await asyncio.wait_for(stream.frames.get(), KEEPALIVE_S)
        except TimeoutError:
            if started:
                yield _event("keepalive", {})
            continue
        if item == stream_pump.LAGGED:
            async for chunk in _from_buffer(stream, last_seq, started):
                yield chunk
            return
        frame, fields = item
        if frame is None:  # ended without a result here (a failure): the row says how
            if not started:
                yield _event("start", {"pid": 0})
            async for chunk in _end_from_row(stream.operation_pk):
                yield chunk
            return
        last_seq = int(frame.get("seq", last_seq))
        kind = frame.get("type")
        if kind == "exec.start":
            started = True
            pid = int(frame.get("pid") or 0)
            async with redis.pipeline(transaction=False) as pipe:
                key = pids_key_of(stream.sandbox_pk, stream.generation)
                pipe.hset(key, str(pid), stream.operation_pk)
                pipe.expire(key, PID_TTL_S)
                await pipe.execute()
            yield _event("start", {"pid": pid})
        elif kind in ("exec.stdout", "exec.stderr"):
            if not started:
                started = True
                yield _event("start", {"pid": 0})
            yield _event("data", {kind[5:]: frame.get("data", "")})
        elif kind == "exec.exit":
            if not started:
                yield _event("start", {"pid": 0})
            if fields is None:
                async for chunk in _end_from_row(stream.operation_pk):
                    yield chunk
                return
            end, error = end_events(SimpleNamespace(request={"timeout": timeout}, **fields))
            if end is not None:
                yield end
            yield connect.end_stream(error)
            return


async def _from_buffer(stream: StreamStarted, after: int, started: bool) -> AsyncIterator[bytes]:
    """A reader that fell behind: the rest from the replay buffer, as the regular
    path reads it."""
    redis = stream_pump.redis_client_async()
    key = frames_key(stream.operation_pk)
    last_id = f"0-{after + 1}"
    while True:
        entries: Any = await redis.xread({key: last_id}, block=int(KEEPALIVE_S * 1000), count=500)
        if not entries:
            if started:
                yield _event("keepalive", {})
            continue
        for _, items in entries:
            for entry_id, raw in items:
                last_id = entry_id.decode()
                frame = json.loads(raw[b"f"])
                kind = frame.get("type")
                if kind in ("exec.stdout", "exec.stderr"):
                    yield _event("data", {kind[5:]: frame.get("data", "")})
                elif kind == "exec.exit":
                    async for chunk in _end_from_row(stream.operation_pk):
                        yield chunk
                    return


async def _end_from_row(operation_pk: str) -> AsyncIterator[bytes]:
    operation = await sync_to_async(_operation)(operation_pk)
    end, error = end_events(operation)
    if end is not None:
        yield end
    yield connect.end_stream(error)


def _operation(operation_pk: str) -> Operation:
    try:
        return Operation.objects.get(pk=operation_pk)
    finally:
        close_old_connections()


def _log_access(status: int, request_id: str, started: float, operation_id: str) -> None:
    """The access line RequestIdMiddleware writes, naming the operation it started."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    token = request_id_var.set(request_id)
    try:
        access_log.info(
            "%s %s %s",
            "POST",
            PATH,
            status,
            extra={
                "event": "request",
                "method": "POST",
                "path": PATH,
                "status": status,
                "operation_id": operation_id,
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
            },
        )
    finally:
        request_id_var.reset(token)
