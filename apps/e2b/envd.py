"""envd, the E2B data plane, under ``/e2b/envd`` (E2B_SANDBOX_URL).

The SDK addresses every call to one base URL and names the sandbox in headers
(``E2b-Sandbox-Id``), authenticating with ``X-Access-Token`` (the signed token the
create answered, apps/e2b/tokens.py). Views authenticate, parse and translate; the
work is Hedgerow's exec and file services.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from apps.billing.principal import Principal
from apps.e2b import connect, process
from apps.e2b.connect import ConnectError
from apps.e2b.tokens import envd_principal
from apps.sandboxes.models import Sandbox, State
from controlplane.errors import ApiError

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


def _streaming(events: Iterator[bytes | ConnectError]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(
        _each(_stream(events)), content_type=connect.STREAM_CONTENT_TYPE
    )
    response["Cache-Control"] = "no-store"
    return response


def _stream_error(exc: ApiError) -> StreamingHttpResponse:
    return _streaming(iter([ConnectError(connect.code_of(exc), exc.message)]))


@csrf_exempt
def process_rpc(request: HttpRequest, method: str) -> HttpResponseBase:
    """``/process.Process/<method>``: Start and Connect stream, the rest are unary."""
    streaming = method in ("Start", "Connect")
    try:
        if request.method != "POST":
            raise ConnectError("unimplemented", f"{request.method} is not a Connect call")
        if method == "Start":
            principal, sandbox = envd_sandbox(request, "write")
            data = connect.read_stream_request(request)
            operation = process.process_start(
                principal=principal, sandbox=sandbox, data=data, timeout=connect.timeout_s(request)
            )
            return _streaming(process.process_events(operation=operation, sandbox=sandbox))
        if method == "Connect":
            _, sandbox = envd_sandbox(request, "read")
            data = connect.read_stream_request(request)
            operation = process.operation_for_pid(sandbox=sandbox, selector=data.get("process"))
            return _streaming(process.process_events(operation=operation, sandbox=sandbox))
        if method == "List":
            _, sandbox = envd_sandbox(request, "read")
            connect.read_unary(request)
            return JsonResponse({"processes": process.process_list(sandbox=sandbox)})
        raise ConnectError("unimplemented", f"process.Process/{method} is not supported yet")
    except ApiError as exc:
        return _stream_error(exc) if streaming else connect.unary_error(exc)
