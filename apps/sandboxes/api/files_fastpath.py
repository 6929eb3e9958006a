"""File uploads (``PUT``/``POST /api/v1/sandboxes/<id>/files`` with a Content-Length)
in front of Django: admitted before a byte of the body is read, then the body streamed
from the client's connection straight to the agent's, on the event loop.

Why: through Django an upload's body is read whole before the view runs — written, on
the event loop, chunk by chunk into a temporary file (a spooled one, on disk past
2.5 MB), then read back 256 KiB at a time by the request's thread and sent to the agent
by httpx (py-spy under ``bench/mixed.py``: a fifth of a web worker's loop time spent in
``SpooledTemporaryFile.write``); and an upload refused with a 429 or a 413 had already
been read whole. Here each piece the server hands over is written to the agent's
socket as it is (no temporary file, no thread per chunk, no re-chunking), and an
upload a limit refuses is answered before its body is read.

What is checked is the regular path's, by the same code (``files.upload_params``,
``transfer_admit``), in one thread hop before the body; the answer is what
``FilesView.put`` answers. Everything this path does not handle goes to Django with
its body unread: no Content-Length (a chunked upload), a key this process has not
cached (or a stale one), a key without ``write``, repeated headers, a query parameter
other than one ``path`` and one ``mode``, a NUL or non-UTF-8 in the query, an
``Accept`` other than JSON, a disallowed Host, or ``HEDGEROW_FILES_FAST_PATH`` off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http.request import split_domain_port, validate_host

from apps.billing.limits import transfer_admit, transfer_release
from apps.core.asgi_body import Receive, Scope, Send
from apps.core.errors import ApiError, _internal_error_body
from apps.core.logging import request_id_var
from apps.sandboxes import selectors
from apps.sandboxes.agent_async import _read_response
from apps.sandboxes.agent_client import AgentError, raise_for_agent_status
from apps.sandboxes.services import files
from apps.sandboxes.services.operations import AgentUnavailable, agent_for
from apps.tenancy.auth import principal_cached
from apps.tenancy.principal import Principal

ASGIApp = Callable[..., Awaitable[None]]

access_log = logging.getLogger("hedgerow.access")
log = logging.getLogger(__name__)

_PATH = re.compile(r"/api/v1/sandboxes/([^/]+)/files")
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_WANTED = {
    b"authorization",
    b"x-api-key",
    b"accept",
    b"x-request-id",
    b"host",
    b"content-length",
    b"transfer-encoding",
}
# Unsent bytes kept for the agent's socket before waiting for it to take them: bounds a
# transfer's memory whatever the client's pace.
WRITE_BUFFER = 1 << 20
AGENT_TIMEOUT_S = 600.0  # as file_write's call to the agent
# What Django's middleware and DRF add to FilesView's answer (SecurityMiddleware,
# XFrameOptionsMiddleware, the APIView's Allow and Vary).
_HEADERS = [
    (b"content-type", b"application/json"),
    (b"vary", b"Accept"),
    (b"allow", b"GET, POST, PUT, DELETE, HEAD, OPTIONS"),
    (b"x-frame-options", b"DENY"),
]
_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


@dataclass(frozen=True)
class _Upload:
    sandbox_id: str
    secret: str
    size: int
    path: str | None
    mode: str | None
    request_id: str


@dataclass(frozen=True)
class _Admitted:
    host: str
    port: int
    token: str
    params: dict[str, Any]
    tenant_id: str
    sandbox_key: str
    lease: str


class FilesFastPath:
    """ASGI middleware: uploads with a known length here, everything else to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upload = None
        if scope["type"] == "http" and scope.get("method") in ("PUT", "POST"):
            match = _PATH.fullmatch(scope["path"])
            if match is not None and settings.HEDGEROW_FILES_FAST_PATH:
                upload = _upload_of(scope, match.group(1))
        principal = principal_cached(upload.secret) if upload is not None else None
        if upload is None or principal is None or not principal.has_scope("write"):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        token = request_id_var.set(upload.request_id)
        try:
            status, payload, headers = await _answer(principal, upload, receive)
        finally:
            request_id_var.reset(token)
        if status is None:
            return  # the client went away mid-body: nobody to answer
        await _send(send, status, payload, upload.request_id, headers)
        _log_access(scope.get("method", "PUT"), scope["path"], status, upload.request_id, started)


def _upload_of(scope: Scope, sandbox_id: str) -> _Upload | None:
    """The request's parts when this path answers it exactly as Django would."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            if name in headers:
                return None  # repeated headers: Django's joining rules apply
            headers[name] = value
    length = headers.get(b"content-length", b"")
    if b"transfer-encoding" in headers or not length.isdigit():
        return None
    if headers.get(b"accept", b"*/*").strip() not in (b"*/*", b"application/json"):
        return None
    if settings.ALLOWED_HOSTS != ["*"]:
        domain, _port = split_domain_port(headers.get(b"host", b"").decode("latin-1"))
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return None
    secret = _key(headers)
    query = _query(scope.get("query_string", b""))
    if secret is None or query is None:
        return None
    incoming = headers.get(b"x-request-id", b"").decode("latin-1")
    request_id = incoming if _VALID_REQUEST_ID.match(incoming) else uuid.uuid4().hex
    return _Upload(
        sandbox_id=sandbox_id,
        secret=secret,
        size=int(length),
        path=query.get("path"),
        mode=query.get("mode"),
        request_id=request_id,
    )


def _query(raw: bytes) -> dict[str, str] | None:
    """``path`` and ``mode``, each at most once, as ``request.query_params`` reads
    them; None (Django answers) for anything else, a NUL (InputGuardMiddleware's typed
    400) or bytes that are not UTF-8 included."""
    try:
        pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        return None
    query = dict(pairs)
    if len(query) != len(pairs) or not query.keys() <= {"path", "mode"}:
        return None
    if any("\x00" in value for value in query.values()):
        return None
    return query


def _key(headers: dict[bytes, bytes]) -> str | None:
    """As ``extract_key``: ``Authorization: Bearer`` first, else ``X-API-Key``."""
    header = headers.get(b"authorization", b"").decode("latin-1")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return headers.get(b"x-api-key", b"").decode("latin-1").strip() or None


_Reply = tuple[int | None, bytes, dict[str, str]]


async def _answer(principal: Principal, upload: _Upload, receive: Receive) -> _Reply:
    """(status, JSON body, the error's own headers); status None when the client went
    away before its body was whole."""
    try:
        admitted = await sync_to_async(_admit, thread_sensitive=False)(principal, upload)
    except ApiError as exc:  # refused before any byte of the body was read
        return exc.status_code, _json(exc.as_dict()), exc.headers
    except Exception:
        log.exception("unhandled error in the upload fast path")
        return 500, _json(_internal_error_body()), {}
    try:
        reply = await _stream(admitted, upload, receive)
        if reply is None:
            return None, b"", {}
        status, data = reply
        raise_for_agent_status(status, data)
        return 200, _json(json.loads(data)), {}
    except AgentError as exc:
        error = files.translate(exc)
        return error.status_code, _json(error.as_dict()), error.headers
    except ApiError as exc:
        return exc.status_code, _json(exc.as_dict()), exc.headers
    except Exception:
        log.exception("unhandled error in the upload fast path")
        return 500, _json(_internal_error_body()), {}
    finally:
        await sync_to_async(_release, thread_sensitive=False)(admitted)


def _admit(principal: Principal, upload: _Upload) -> _Admitted:
    """The regular path's checks, tenancy first (another tenant's sandbox is a 404),
    and a slot in the file-transfer pools (429 naming the limit)."""
    try:
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=upload.sandbox_id)
        params = files.upload_params(
            sandbox=sandbox,
            path=upload.path,
            size=upload.size,
            max_bytes=int(settings.HEDGEROW_MAX_UPLOAD_BYTES),
            mode=upload.mode,
        )
        agent = agent_for(sandbox)
        tenant_id, key = str(sandbox.tenant_id), str(sandbox.external_id)
        lease = transfer_admit(tenant_id=tenant_id, sandbox_key=key, nbytes=upload.size)
    finally:
        connection.close()  # this executor thread keeps no connection (or pool slot)
    token = agent.headers["Authorization"].removeprefix("Bearer ")
    return _Admitted(agent.host, agent.port, token, params, tenant_id, key, lease)


def _release(admitted: _Admitted) -> None:
    transfer_release(
        tenant_id=admitted.tenant_id, sandbox_key=admitted.sandbox_key, lease=admitted.lease
    )


async def _stream(
    admitted: _Admitted, upload: _Upload, receive: Receive
) -> tuple[int, bytes] | None:
    """The body from the client to the agent as it arrives; the agent's (status, body),
    or None when the client went away (the agent's half-written temporary file is
    dropped with the connection: uploads are atomic)."""
    base = f"http://{admitted.host}:{admitted.port}"
    head = (
        f"PUT /files?{urlencode(admitted.params)} HTTP/1.1\r\n"
        f"Host: {admitted.host}:{admitted.port}\r\n"
        f"Authorization: Bearer {admitted.token}\r\n"
        f"Content-Length: {upload.size}\r\nConnection: close\r\n"
        f"X-Request-Id: {upload.request_id}\r\n\r\n"
    ).encode("latin-1")
    try:
        async with asyncio.timeout(AGENT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(admitted.host, admitted.port)
    except (OSError, TimeoutError) as exc:
        raise AgentUnavailable(f"agent at {base} unreachable: {exc!r}") from exc
    try:
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER)
        writer.write(head)
        broken: BaseException | None = None
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            more = bool(message.get("more_body", False))
            if broken is None:
                try:
                    writer.write(message.get("body", b""))
                    if writer.transport.get_write_buffer_size() > WRITE_BUFFER:
                        async with asyncio.timeout(AGENT_TIMEOUT_S):
                            await writer.drain()
                except (OSError, TimeoutError) as exc:
                    # The agent stopped reading: its answer (a typed error, e.g. over
                    # max_bytes) says why; the client's remaining bytes are discarded
                    # by the server after the answer.
                    broken = exc
                    break
        try:
            async with asyncio.timeout(AGENT_TIMEOUT_S):
                if broken is None:
                    await writer.drain()
                status, data, _keep = await _read_response(reader)
        except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            raise AgentUnavailable(f"agent at {base}: {broken or exc!r}") from exc
        return status, data
    finally:
        writer.close()
        with contextlib.suppress(OSError, RuntimeError):
            writer.transport.abort()


def _json(data: Any) -> bytes:
    """DRF's JSONRenderer with this project's settings (compact, UTF-8, strict)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").encode()


async def _send(
    send: Send, status: int, payload: bytes, request_id: str, extra: dict[str, str]
) -> None:
    headers = [
        *_HEADERS,
        (b"content-length", str(len(payload)).encode()),
        (b"x-request-id", request_id.encode()),
        *(
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in extra.items()
        ),
        *_SECURITY_HEADERS,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _log_access(method: str, path: str, status: int, request_id: str, started: float) -> None:
    """The same structured line as RequestIdMiddleware (the web end of a trace)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    token = request_id_var.set(request_id)
    try:
        access_log.info(
            "%s %s %s",
            method,
            path,
            status,
            extra={
                "event": "request",
                "method": method,
                "path": path,
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
            },
        )
    finally:
        request_id_var.reset(token)
