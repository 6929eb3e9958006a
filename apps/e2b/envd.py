"""envd, the E2B data plane, under ``/e2b/envd`` (E2B_SANDBOX_URL).

The SDK addresses every call to one base URL and names the sandbox in headers
(``E2b-Sandbox-Id``), authenticating with ``X-Access-Token`` (the signed token the
create answered, apps/e2b/tokens.py). Views authenticate, parse and translate; the
work is Hedgerow's exec and file services.
"""

from __future__ import annotations

import itertools
import posixpath
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, Any, cast

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.multipartparser import MultiPartParser
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from apps.core.errors import ApiError
from apps.e2b import connect, filesystem, process, pty
from apps.e2b.connect import ConnectError
from apps.e2b.tokens import envd_principal
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services import files
from apps.tenancy.principal import Principal

Handler = Callable[..., Any]
# E2B's proxy answers a sandbox that is gone with this (the SDK reads "was not found").
GONE = "the sandbox {} was not found"


def envd_sandbox(request: HttpRequest, scope: str) -> tuple[Principal, Sandbox]:
    """The token's principal and sandbox. A sandbox of another team, one that ended, or
    one the E2b-Sandbox-Id header does not name is gone (502, as E2B's proxy answers)."""
    principal, sandbox_pk = envd_principal(request.headers.get("X-Access-Token", ""))
    if not principal.has_scope(scope):
        raise ApiError(f"this key lacks the {scope!r} scope", code="forbidden", status_code=403)
    named = request.headers.get("E2b-Sandbox-Id", "")
    sandbox = (
        Sandbox.objects.for_tenant(principal.tenant)
        .select_related("tenant")
        .filter(pk=sandbox_pk)
        .first()
    )
    if (
        sandbox is None
        or (named and named != sandbox.external_id)
        or sandbox.state not in (State.READY, State.PROVISIONING, State.REQUESTED)
    ):
        raise ApiError(GONE.format(named or sandbox_pk), code="sandbox_not_found", status_code=502)
    return principal, sandbox


@csrf_exempt
def health(request: HttpRequest) -> HttpResponse:
    try:
        envd_sandbox(request, "read")
    except ApiError as exc:
        return JsonResponse(
            {"code": exc.status_code, "message": exc.message}, status=exc.status_code
        )
    return HttpResponse(status=204)


def _stream(events: Iterator[bytes | ConnectError]) -> Iterator[bytes]:
    try:
        for item in events:
            if isinstance(item, ConnectError):
                yield connect.end_stream(item)
                return
            yield item
    except ApiError as exc:
        yield connect.end_stream(exc)
        return
    yield connect.end_stream()


async def _each(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """The chunks one by one, each produced in the request's thread (the ORM's
    connection lives there). Django would read a synchronous iterator whole before
    sending any of it under ASGI: a command's output must go out as it comes."""
    done = object()
    step = sync_to_async(lambda: next(chunks, done))
    while True:
        chunk = await step()
        if chunk is done:
            return
        assert isinstance(chunk, bytes)
        yield chunk


def _release_db() -> None:
    """Hands the request's DB connection back before a long stream: a stream holds its
    request thread for as long as the command or terminal runs, and hundreds of them
    must not hold hundreds of connections (the pool would time out). Whatever reads
    the database later checks one out again."""
    if not connection.in_atomic_block:
        connection.close()


def _streaming(events: Iterator[bytes | ConnectError]) -> StreamingHttpResponse:
    _release_db()
    response = StreamingHttpResponse(
        _each(_stream(events)), content_type=connect.STREAM_CONTENT_TYPE
    )
    response["Cache-Control"] = "no-store"
    return response


def _streaming_async(chunks: AsyncIterator[bytes]) -> StreamingHttpResponse:
    _release_db()
    response = StreamingHttpResponse(chunks, content_type=connect.STREAM_CONTENT_TYPE)
    response["Cache-Control"] = "no-store"
    return response


def _stream_error(exc: ApiError) -> StreamingHttpResponse:
    return _streaming(iter([ConnectError(connect.code_of(exc), exc.message)]))


@csrf_exempt
def process_rpc(request: HttpRequest, method: str) -> HttpResponseBase:
    """``/process.Process/<method>``: Start and Connect stream, the rest are unary."""
    streaming = method in ("Start", "Connect", "StreamInput")
    try:
        if request.method != "POST":
            raise ConnectError("unimplemented", f"{request.method} is not a Connect call")
        if method == "Start":
            principal, sandbox = envd_sandbox(request, "write")
            data = connect.read_stream_request(request)
            if data.get("pty"):
                return _streaming_async(
                    pty.pty_events(
                        sandbox=sandbox, init=pty.agent_init(data), limits=pty.pty_limits(sandbox)
                    )
                )
            operation = process.process_start(
                principal=principal, sandbox=sandbox, data=data, timeout=connect.timeout_s(request)
            )
            return _streaming(process.process_events(operation=operation, sandbox=sandbox))
        if method == "StreamInput":
            _, sandbox = envd_sandbox(request, "write")
            messages = connect.read_client_stream(request)
            process.process_stream_input(sandbox=sandbox, messages=messages)
            return _streaming(iter([connect.envelope({})]))
        if method == "Connect":
            _, sandbox = envd_sandbox(request, "read")
            data = connect.read_stream_request(request)
            operation = process.operation_for_pid(sandbox=sandbox, selector=data.get("process"))
            return _streaming(process.process_events(operation=operation, sandbox=sandbox))
        if method == "List":
            _, sandbox = envd_sandbox(request, "read")
            connect.read_unary(request)
            return JsonResponse({"processes": process.process_list(sandbox=sandbox)})
        if method == "SendSignal":
            _, sandbox = envd_sandbox(request, "write")
            data = connect.read_unary(request)
            channel = pty.pty_channel(sandbox=sandbox, selector=data.get("process"))
            if channel is not None:
                pty.pty_publish(channel=channel, message={"op": "kill"})
            else:
                process.process_signal(sandbox=sandbox, data=data)
            return JsonResponse({})
        if method in ("SendInput", "Update"):
            _, sandbox = envd_sandbox(request, "write")
            data = connect.read_unary(request)
            channel = pty.pty_channel(sandbox=sandbox, selector=data.get("process"))
            if channel is None:
                operation = process.operation_for_pid(sandbox=sandbox, selector=data.get("process"))
                if method == "Update":
                    raise ConnectError("unimplemented", "resizing is served for PTY processes only")
                process.process_send_input(operation=operation, data=data.get("input"))
                return JsonResponse({})
            message = (
                pty.pty_input(data.get("input"))
                if method == "SendInput"
                else pty.pty_resize(data.get("pty"))
            )
            pty.pty_publish(channel=channel, message=message)
            return JsonResponse({})
        if method == "CloseStdin":
            _, sandbox = envd_sandbox(request, "write")
            data = connect.read_unary(request)
            if pty.pty_channel(sandbox=sandbox, selector=data.get("process")) is not None:
                raise ConnectError("unimplemented", "a terminal's stdin cannot be closed")
            operation = process.operation_for_pid(sandbox=sandbox, selector=data.get("process"))
            process.process_send_input(operation=operation, data=None, eof=True)
            return JsonResponse({})
        raise ConnectError("unimplemented", f"process.Process/{method} is not supported yet")
    except ApiError as exc:
        return _stream_error(exc) if streaming else connect.unary_error(exc)


def _http_error(exc: ApiError) -> JsonResponse:
    """envd's HTTP API error shape: ``{"code": <status>, "message"}``."""
    status = exc.status_code
    if isinstance(exc, ConnectError):
        status = {"not_found": 404, "invalid_argument": 400}.get(exc.connect_code, status)
    return JsonResponse({"code": status, "message": exc.message}, status=status)


def _body_chunks(request: HttpRequest) -> Iterator[bytes]:
    while chunk := request.read(files.CHUNK):
        yield chunk


def _gunzip(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """A gzip body inflated chunk by chunk (at most ``files.CHUNK`` bytes out at a time:
    the upload limit bounds what a small body may inflate to). A corrupt or cut-short
    body fails the write, whose temporary file is then discarded (nothing half-written)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    for chunk in chunks:
        data = chunk
        while data:
            try:
                out = inflater.decompress(data, files.CHUNK)
            except zlib.error as exc:
                raise ApiError(f"the gzip body is corrupt: {exc}", status_code=400) from None
            if out:
                yield out
            data = inflater.unconsumed_tail
    rest = inflater.flush()
    if rest:
        yield rest
    if not inflater.eof:
        raise ApiError("the gzip body is cut short", status_code=400)


@csrf_exempt
def files_http(request: HttpRequest) -> HttpResponseBase:
    """``GET /files?path=`` streams a file; ``POST /files`` writes one or more, as a
    multipart body (one ``file`` part per file, its filename the path) or, for one
    file, a raw ``application/octet-stream`` body with ``?path=``."""
    try:
        if request.method == "GET":
            _, sandbox = envd_sandbox(request, "read")
            path = filesystem.path_of(request.GET.get("path"))
            download = files.file_open(sandbox=sandbox, path=path)
            response = StreamingHttpResponse(
                download.chunks(), content_type="application/octet-stream"
            )
            response["Content-Length"] = str(download.size)
            response._resource_closers.append(download.close)  # type: ignore[attr-defined]
            _release_db()
            return response
        if request.method != "POST":
            raise ApiError(f"{request.method} is not allowed here", status_code=405)
        _, sandbox = envd_sandbox(request, "write")
        limit = int(settings.HEDGEROW_MAX_UPLOAD_BYTES)
        written: list[dict[str, Any]] = []
        content_type = request.content_type or ""
        if any(name.lower().startswith("x-metadata-") for name in request.headers):
            # The SDK sends file metadata (user.e2b.* xattrs) as these headers: refused
            # rather than written without it.
            raise ApiError("file metadata (X-Metadata-* headers) is not supported", status_code=400)
        if content_type == "application/octet-stream":
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in ("", "identity", "gzip"):
                raise ApiError(f"Content-Encoding {encoding!r} is not supported", status_code=400)
            path = filesystem.path_of(request.GET.get("path"))
            length = request.headers.get("Content-Length", "")
            chunks = _body_chunks(request)
            if encoding == "gzip":  # the SDK's gzip=True: inflated as it streams
                head = next(chunks, b"")
                if head[:2] != b"\x1f\x8b":  # refused before anything is sent or counted
                    raise ApiError("the body is not gzip (Content-Encoding: gzip)", status_code=400)
                chunks = _gunzip(itertools.chain([head], chunks))
            files.file_write(
                sandbox=sandbox,
                path=path,
                chunks=chunks,
                size=int(length) if length.isdigit() and encoding != "gzip" else None,
                max_bytes=limit,
            )
            written.append(_written(path))
        elif content_type == "multipart/form-data":
            parser = _PathKeepingParser(
                request.META, cast(IO[bytes], request), request.upload_handlers, request.encoding
            )
            _, uploaded = parser.parse()
            parts = uploaded.getlist("file")
            if not parts or set(uploaded) != {"file"} or len(parser.names) != len(parts):
                raise ApiError(
                    "the multipart body must hold 'file' parts, each named by its path",
                    status_code=400,
                )
            only = request.GET.get("path") if len(parts) == 1 else None
            for part, name in zip(parts, parser.names, strict=True):
                path = filesystem.path_of(only or name)
                files.file_write(
                    sandbox=sandbox,
                    path=path,
                    chunks=part.chunks(files.CHUNK),
                    size=part.size,
                    max_bytes=limit,
                )
                written.append(_written(path))
        else:
            raise ApiError(
                "the body must be multipart/form-data or application/octet-stream",
                status_code=400,
            )
        return JsonResponse(written, safe=False)
    except ApiError as exc:
        return _http_error(exc)


class _PathKeepingParser(MultiPartParser):
    """Django's parser, keeping each part's whole filename in ``names`` (in order): the
    SDK puts the file's destination path there, and Django cuts a file's ``name`` to
    its last component."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.names: list[str] = []

    def sanitize_file_name(self, file_name: str) -> str | None:
        self.names.append(file_name)
        return file_name or None


def _written(path: str) -> dict[str, Any]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


@csrf_exempt
def filesystem_rpc(request: HttpRequest, method: str) -> HttpResponseBase:
    """``/filesystem.Filesystem/<method>``: the unary calls, and WatchDir's stream."""
    try:
        if request.method != "POST":
            raise ConnectError("unimplemented", f"{request.method} is not a Connect call")
        if method == "WatchDir":
            _, sandbox = envd_sandbox(request, "read")
            data = connect.read_stream_request(request)
            events = filesystem.watch_dir_events(sandbox=sandbox, data=data)
            return _streaming(_first(events))
        if method in ("CreateWatcher", "GetWatcherEvents", "RemoveWatcher"):
            _, sandbox = envd_sandbox(request, "read")
            data = connect.read_unary(request)
            if method == "CreateWatcher":
                return JsonResponse(filesystem.watcher_create(sandbox=sandbox, data=data))
            if method == "GetWatcherEvents":
                return JsonResponse(filesystem.watcher_events(sandbox=sandbox, data=data))
            return JsonResponse(filesystem.watcher_remove(sandbox=sandbox, data=data))
        if method in ("Stat", "ListDir"):
            _, sandbox = envd_sandbox(request, "read")
            data = connect.read_unary(request)
            if method == "Stat":
                return JsonResponse(filesystem.stat(sandbox=sandbox, path=data.get("path")))
            return JsonResponse(
                filesystem.list_dir(sandbox=sandbox, path=data.get("path"), depth=data.get("depth"))
            )
        if method in ("MakeDir", "Move", "Remove"):
            principal, sandbox = envd_sandbox(request, "write")
            data = connect.read_unary(request)
            if method == "MakeDir":
                result = filesystem.make_dir(
                    principal=principal, sandbox=sandbox, path=data.get("path")
                )
            elif method == "Move":
                result = filesystem.move(
                    principal=principal,
                    sandbox=sandbox,
                    source=data.get("source"),
                    destination=data.get("destination"),
                )
            else:
                result = filesystem.remove(
                    principal=principal, sandbox=sandbox, path=data.get("path")
                )
            return JsonResponse(result)
        raise ConnectError("unimplemented", f"filesystem.Filesystem/{method} is not supported yet")
    except ApiError as exc:
        if method == "WatchDir":
            return _stream_error(exc)
        return connect.unary_error(exc)


def _first(events: Iterator[bytes]) -> Iterator[bytes | ConnectError]:
    """The stream with its first chunk produced before the response starts: a watcher
    that cannot be created is the call's error, not a stream that starts then fails."""
    first = next(events)
    return itertools.chain([first], events)
