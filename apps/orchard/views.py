"""The Orchard Env REST API under ``/orchard`` (see docs/orchard.md).

Errors are ``{"detail": message, "code": code}`` (what the Orchard SDK reads); every
response, DELETE included, is JSON. Views only authenticate, parse, and call services.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.exceptions import AuthenticationFailed

from apps.core.errors import ApiError, NotFound
from apps.core.inputs import json_loads
from apps.orchard import files, jobs, services
from apps.sandboxes import selectors
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.lifecycle import sandbox_delete, sandbox_heartbeat
from apps.sandboxes.services.waiting import sandbox_wait_settled
from apps.tenancy.auth import client_address, principal_for_key
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)

MAX_WAIT_S = 300.0
# What Django allowed before (DATA_UPLOAD_MAX_MEMORY_SIZE); file uploads get more.
MAX_BODY = 2621440
Handler = Callable[..., Any]


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Any:
    response = JsonResponse({"detail": message, "code": code}, status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def _principal(request: HttpRequest, scope: str) -> Principal:
    secret = (request.headers.get("X-API-Key") or "").strip()
    if not secret:
        raise ApiError("missing X-API-Key header", code="not_authenticated", status_code=401)
    try:
        principal = principal_for_key(secret, client_address(request.META))
    except AuthenticationFailed as exc:
        raise ApiError(str(exc.detail), code="invalid_api_key", status_code=403) from exc
    if not principal.has_scope(scope):
        raise ApiError(f"this key lacks the {scope!r} scope", code="forbidden", status_code=403)
    return principal


def _body(request: HttpRequest, limit: int = MAX_BODY) -> dict[str, Any]:
    """The JSON object body, read once from the stream (not ``request.body``, whose
    2.5 MB cap answered a file upload with Django's HTML 400), at most ``limit`` bytes:
    more is a 413 before (Content-Length) or while reading."""
    declared = request.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    raw = request.read(limit + 1)
    if len(raw) > limit:
        raise _too_large(limit)
    if not raw:
        return {}
    data = json_loads(raw)
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object", code="malformed_request")
    return data


def _too_large(limit: int) -> ApiError:
    return ApiError(f"the body exceeds {limit} bytes", code="too_large", status_code=413)


def endpoint(*methods: str) -> Callable[[Handler], Handler]:
    """Method check, key auth (reads need ``read``, writes ``write``) and the error
    shape. The handler gets (request, principal, **url kwargs) and returns a dict."""

    def decorate(handler: Handler) -> Handler:
        @csrf_exempt
        @functools.wraps(handler)
        def view(request: HttpRequest, **kwargs: Any) -> Any:
            if request.method not in methods:
                response = _error(405, f"{request.method} is not allowed here", "not_allowed")
                response["Allow"] = ", ".join(methods)
                return response
            try:
                scope = "read" if request.method == "GET" else "write"
                principal = _principal(request, scope)
                return JsonResponse(handler(request, principal, **kwargs))
            except ApiError as exc:
                return _error(exc.status_code, exc.message, exc.code, exc.headers)

        return view

    return decorate


def _sandbox(principal: Principal, sandbox_id: str) -> Sandbox:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    if sandbox.state == State.DELETED:
        raise NotFound(f"sandbox {sandbox_id!r} was deleted", code="sandbox_not_found")
    return sandbox


def _seconds(request: HttpRequest, default: float) -> float:
    raw = request.GET.get("timeout")
    if raw is None or raw == "":
        return default
    try:
        return min(max(float(raw), 0.0), MAX_WAIT_S)
    except ValueError:
        raise ApiError("timeout must be a number", field="timeout") from None


def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok", "service": "hedgerow", "api": "orchard"})


@endpoint("POST")
def sandbox_create(request: HttpRequest, principal: Principal) -> dict[str, Any]:
    sandbox, timeout = services.orchard_sandbox_create(principal=principal, data=_body(request))
    return services.orchard_sandbox_view(sandbox, timeout=timeout)


@endpoint("GET", "DELETE")
def sandbox_detail(request: HttpRequest, principal: Principal, sandbox_id: str) -> dict[str, Any]:
    if request.method == "DELETE":
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        sandbox_delete(sandbox=sandbox, actor=principal.actor)
        return {"status": "deleted", "sandbox_id": sandbox.external_id, "state": sandbox.state}
    return services.orchard_sandbox_view(_sandbox(principal, sandbox_id))


@endpoint("GET")
def sandbox_wait(request: HttpRequest, principal: Principal, sandbox_id: str) -> dict[str, Any]:
    sandbox = _sandbox(principal, sandbox_id)
    timeout = _seconds(request, 60.0)
    sandbox = sandbox_wait_settled(sandbox=sandbox, timeout_s=timeout)
    if sandbox.state in (State.QUEUED, State.REQUESTED, State.PROVISIONING):
        raise ApiError(
            f"sandbox {sandbox_id} not ready after {timeout:g}s (still {sandbox.state})",
            code="wait_timeout",
            status_code=408,
        )
    view = services.orchard_sandbox_view(sandbox)
    if sandbox.state in (State.TERMINATING, State.DELETED):
        # The Orchard SDK stops waiting on "failed" and shows the message.
        view["status"] = "failed"
        view["status_message"] = f"the sandbox is {sandbox.state}"
    return view


@endpoint("POST")
def sandbox_heartbeat_view(
    request: HttpRequest, principal: Principal, sandbox_id: str
) -> dict[str, Any]:
    sandbox = sandbox_heartbeat(sandbox=_sandbox(principal, sandbox_id))
    last = sandbox.last_heartbeat_at
    return {
        "status": "ok",
        "sandbox_id": sandbox.external_id,
        "last_heartbeat_at": last.timestamp() if last else None,
    }


@endpoint("POST")
def sandbox_exec(request: HttpRequest, principal: Principal, sandbox_id: str) -> dict[str, Any]:
    sandbox = _sandbox(principal, sandbox_id)
    data = _body(request)
    exec_request = jobs.exec_request(data)
    operation = jobs.job_submit(principal=principal, sandbox=sandbox, request=exec_request)
    if data.get("wait"):
        # Bounded below the clients' HTTP timeouts: past it the answer is `running`
        # and the client polls /jobs, instead of timing out and submitting again.
        wait_s = min(
            (exec_request.timeout or MAX_WAIT_S) + 5.0, settings.HEDGEROW_ORCHARD_EXEC_WAIT_S
        )
        operation = jobs.job_wait(operation=operation, timeout_s=wait_s)
    return jobs.job_view(operation)


@endpoint("GET")
def job_detail(request: HttpRequest, principal: Principal, job_id: str) -> dict[str, Any]:
    return jobs.job_view(jobs.job_get(tenant=principal.tenant, job_id=job_id))


@endpoint("GET")
def job_wait(request: HttpRequest, principal: Principal, job_id: str) -> dict[str, Any]:
    operation = jobs.job_get(tenant=principal.tenant, job_id=job_id)
    operation = jobs.job_wait(operation=operation, timeout_s=_seconds(request, 30.0))
    return jobs.job_view(operation)


@endpoint("POST")
def apply_patch(request: HttpRequest, principal: Principal, sandbox_id: str) -> dict[str, Any]:
    data = _body(request)
    return files.patch_apply(
        principal=principal,
        sandbox=_sandbox(principal, sandbox_id),
        patch=data.get("patch"),
        timeout=data.get("timeout_seconds"),
        cwd=data.get("cwd"),
    )


@endpoint("GET", "POST")
def sandbox_files(request: HttpRequest, principal: Principal, sandbox_id: str) -> dict[str, Any]:
    sandbox = _sandbox(principal, sandbox_id)
    if request.method == "POST":
        data = _body(request, files.MAX_UPLOAD_BODY)
        return files.file_upload(
            sandbox=sandbox, path=data.get("path"), content=data.get("content")
        )
    return files.file_download(sandbox=sandbox, path=request.GET.get("path"))


@endpoint("GET")
def sandbox_files_list(
    request: HttpRequest, principal: Principal, sandbox_id: str
) -> dict[str, Any]:
    sandbox = _sandbox(principal, sandbox_id)
    return files.file_listing(
        sandbox=sandbox,
        path=request.GET.get("path"),
        limit=request.GET.get("limit"),
        cursor=request.GET.get("cursor"),
    )


@endpoint("GET")
def resources(request: HttpRequest, principal: Principal) -> dict[str, Any]:
    return services.orchard_resources(tenant=principal.tenant)


def not_found(request: HttpRequest, path: str = "") -> JsonResponse:
    return JsonResponse({"detail": "not found", "code": "not_found"}, status=404)
