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

Downloads (``GET`` with ``path`` only, no body) too: through Django each 256 KiB chunk
of the agent's answer is a hop into a thread and back (futures, a wake-up of the loop);
here the agent's socket is read up to READ_CHUNK at a time straight into the response,
after the same checks in the same order (``files.download_target``, the agent's typed
error before any header, then ``transfer_admit`` weighing the size).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import posixpath
import re
import time
import uuid
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
from apps.sandboxes.api import transfer_gate
from apps.sandboxes.api.fastpath_response import (
    SECURITY_HEADERS,
    VALID_REQUEST_ID,
    ASGIApp,
    json_bytes,
    log_access,
    send_json,
    view_headers,
)
from apps.sandboxes.services import files
from apps.sandboxes.services.operations import AgentUnavailable, agent_for
from apps.tenancy.auth import principal_cached
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)

_PATH = re.compile(r"/api/v1/sandboxes/([^/]+)/files")
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
AGENT_OPEN_TIMEOUT_S = 30.0  # as stream_download's (per read)
# A download's piece per read from the agent's socket (Django's path: 256 KiB per hop).
READ_CHUNK = 1 << 20
# What Django's middleware and DRF add to FilesView's answer (SecurityMiddleware,
# XFrameOptionsMiddleware, the APIView's Allow and Vary).
_HEADERS = view_headers(b"GET, POST, PUT, DELETE, HEAD, OPTIONS")


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
        method = scope.get("method") if scope["type"] == "http" else None
        if method in ("PUT", "POST", "GET"):
            match = _PATH.fullmatch(scope["path"])
            if match is not None and settings.HEDGEROW_FILES_FAST_PATH:
                upload = _upload_of(scope, match.group(1), download=method == "GET")
        principal = principal_cached(upload.secret) if upload is not None else None
        scope_needed = "read" if method == "GET" else "write"
        if upload is None or principal is None or not principal.has_scope(scope_needed):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        token = request_id_var.set(upload.request_id)
        status: int | None
        try:
            if method == "GET":
                status = await _download(principal, upload, receive, send)
            else:
                status, payload, headers = await _answer(principal, upload, receive)
                if status is not None:
                    await send_json(send, _HEADERS, status, payload, upload.request_id, headers)
        finally:
            request_id_var.reset(token)
        if status is not None:  # None: the client went away mid-body, nobody to answer
            log_access(str(method), scope["path"], status, upload.request_id, started)


def _upload_of(scope: Scope, sandbox_id: str, *, download: bool = False) -> _Upload | None:
    """The request's parts when this path answers it exactly as Django would (a
    download: a GET without a body, ``path`` its only parameter)."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            if name in headers:
                return None  # repeated headers: Django's joining rules apply
            headers[name] = value
    length = headers.get(b"content-length", b"0" if download else b"")
    if b"transfer-encoding" in headers or not length.isdigit():
        return None
    if download and int(length):
        return None
    if headers.get(b"accept", b"*/*").strip() not in (b"*/*", b"application/json"):
        return None
    if settings.ALLOWED_HOSTS != ["*"]:
        domain, _port = split_domain_port(headers.get(b"host", b"").decode("latin-1"))
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return None
    secret = _key(headers)
    query = _query(scope.get("query_string", b""))
    if secret is None or query is None or (download and "mode" in query):
        return None
    incoming = headers.get(b"x-request-id", b"").decode("latin-1")
    request_id = incoming if VALID_REQUEST_ID.match(incoming) else uuid.uuid4().hex
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
        return exc.status_code, json_bytes(exc.as_dict()), exc.headers
    except Exception:
        log.exception("unhandled error in the upload fast path")
        return 500, json_bytes(_internal_error_body()), {}
    try:
        reply = await _stream(admitted, upload, receive)
        if reply is None:
            return None, b"", {}
        status, data = reply
        raise_for_agent_status(status, data)
        return 200, json_bytes(json.loads(data)), {}
    except AgentError as exc:
        error = files.translate(exc)
        return error.status_code, json_bytes(error.as_dict()), error.headers
    except ApiError as exc:
        return exc.status_code, json_bytes(exc.as_dict()), exc.headers
    except Exception:
        log.exception("unhandled error in the upload fast path")
        return 500, json_bytes(_internal_error_body()), {}
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
        paced = transfer_gate.Paced()
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            more = bool(message.get("more_body", False))
            if broken is None:
                try:
                    piece = message.get("body", b"")
                    writer.write(piece)
                    await paced.moved(len(piece))  # after short execs (bounded)
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


@dataclass(frozen=True)
class _Source:
    host: str
    port: int
    token: str
    path: str
    tenant_id: str
    sandbox_key: str


def _download_checks(principal: Principal, download: _Upload) -> _Source:
    """The regular path's checks before the agent is asked (``files.download_target``:
    tenancy, ready, the path)."""
    try:
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=download.sandbox_id)
        target = files.download_target(sandbox=sandbox, path=download.path)
        agent = agent_for(sandbox)
    finally:
        connection.close()
    token = agent.headers["Authorization"].removeprefix("Bearer ")
    return _Source(
        agent.host, agent.port, token, target, str(sandbox.tenant_id), str(sandbox.external_id)
    )


async def _agent_open(
    source: _Source, request_id: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """The agent's ``GET /files`` opened: (reader at the body, writer, size); its typed
    error (missing, unreadable, not a regular file) raised before any header goes out."""
    base = f"http://{source.host}:{source.port}"
    head = (
        f"GET /files?{urlencode({'path': source.path})} HTTP/1.1\r\n"
        f"Host: {source.host}:{source.port}\r\nAuthorization: Bearer {source.token}\r\n"
        f"Connection: close\r\nX-Request-Id: {request_id}\r\n\r\n"
    ).encode("latin-1")
    try:
        async with asyncio.timeout(AGENT_OPEN_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(source.host, source.port)
    except (OSError, TimeoutError) as exc:
        raise AgentUnavailable(f"agent at {base} unreachable: {exc!r}") from exc
    try:
        async with asyncio.timeout(AGENT_OPEN_TIMEOUT_S):
            writer.write(head)
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            fields = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in lines[1:] if line)
            }
            size = int(fields.get("content-length", "-1"))
            if status >= 400:
                data = await reader.readexactly(size) if 0 <= size <= 1 << 20 else b""
                raise_for_agent_status(status, data)
            if status != 200 or size < 0:
                raise AgentUnavailable(f"agent at {base}: unexpected answer {lines[0]!r}")
    except AgentError as exc:
        writer.close()
        raise files.translate(exc) from exc
    except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        writer.close()
        raise AgentUnavailable(f"agent at {base} unreachable: {exc!r}") from exc
    except BaseException:
        writer.close()
        raise
    return reader, writer, size


async def _download(principal: Principal, download: _Upload, receive: Receive, send: Send) -> int:
    """Answers a download: its typed error, or the file's bytes as the agent sends
    them, read in pieces of up to READ_CHUNK straight into the response (no thread hop
    per chunk). Returns the status."""
    rid = download.request_id
    try:
        source = await sync_to_async(_download_checks, thread_sensitive=False)(principal, download)
        reader, writer, size = await _agent_open(source, rid)
    except ApiError as exc:
        await send_json(
            send, _HEADERS, exc.status_code, json_bytes(exc.as_dict()), rid, exc.headers
        )
        return exc.status_code
    except Exception:
        log.exception("unhandled error in the download fast path")
        await send_json(send, _HEADERS, 500, json_bytes(_internal_error_body()), rid, {})
        return 500
    try:
        lease = await sync_to_async(transfer_admit, thread_sensitive=False)(
            tenant_id=source.tenant_id, sandbox_key=source.sandbox_key, nbytes=size
        )
    except ApiError as exc:
        writer.close()
        await send_json(
            send, _HEADERS, exc.status_code, json_bytes(exc.as_dict()), rid, exc.headers
        )
        return exc.status_code
    except BaseException:
        writer.close()
        raise
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    try:
        name = posixpath.basename(download.path or "") or "file"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/octet-stream"),
                    (b"content-length", str(size).encode()),
                    (b"content-disposition", f'attachment; filename="{name}"'.encode()),
                    *_HEADERS[1:],
                    (b"x-request-id", rid.encode()),
                    *SECURITY_HEADERS,
                ],
            }
        )
        left = size
        while left and not gone.is_set():
            async with asyncio.timeout(AGENT_OPEN_TIMEOUT_S):
                chunk = await reader.read(min(READ_CHUNK, left))
            if not chunk:
                # The file shrank: end without completing, so the server drops the
                # connection (never a short body that looks whole).
                log.warning("download of %s ended %d bytes short", source.path, left)
                return 200
            left -= len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
            if left:
                await transfer_gate.turn(len(chunk))  # after short execs (bounded)
        if size == 0:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200
    finally:
        watcher.cancel()
        writer.close()
        await sync_to_async(transfer_release, thread_sensitive=False)(
            tenant_id=source.tenant_id, sandbox_key=source.sandbox_key, lease=lease
        )
