"""The E2B control-plane REST API under ``/e2b`` (see docs/e2b.md).

Errors are E2B's ``{"code": <status>, "message": …}`` (what the SDK reads into its
exceptions) with Hedgerow's typed envelope beside it under ``error``. Views only
authenticate, parse, and call services.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.exceptions import AuthenticationFailed

from apps.core.errors import ApiError
from apps.core.inputs import json_loads
from apps.e2b import pausing, services
from apps.tenancy.auth import client_address, principal_for_key
from apps.tenancy.principal import Principal

MAX_BODY = 256 * 1024
Handler = Callable[..., Any]


def error_response(exc: ApiError) -> JsonResponse:
    body: dict[str, Any] = {"code": exc.status_code, "message": exc.message}
    body.update(exc.as_dict())
    response = JsonResponse(body, status=exc.status_code)
    for name, value in exc.headers.items():
        response[name] = value
    return response


def _principal(request: HttpRequest, scope: str) -> Principal:
    secret = (request.headers.get("X-API-Key") or "").strip()
    if not secret:
        raise ApiError("missing X-API-KEY header", code="not_authenticated", status_code=401)
    try:
        principal = principal_for_key(secret, client_address(request.META))
    except AuthenticationFailed as exc:
        raise ApiError(str(exc.detail), code="invalid_api_key", status_code=401) from exc
    if not principal.has_scope(scope):
        raise ApiError(f"this key lacks the {scope!r} scope", code="forbidden", status_code=403)
    return principal


def _body(request: HttpRequest) -> dict[str, Any]:
    declared = request.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(f"the body exceeds {MAX_BODY} bytes", code="too_large", status_code=413)
    raw = request.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise ApiError(f"the body exceeds {MAX_BODY} bytes", code="too_large", status_code=413)
    if not raw:
        return {}
    data = json_loads(raw)
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object", code="malformed_request")
    return data


def endpoint(*methods: str) -> Callable[[Handler], Handler]:
    """Method check, key auth (GET needs ``read``, the rest ``write``) and the error
    shape. The handler gets (request, principal, **url kwargs) and returns a response,
    a JSON-able value, or None for 204."""

    def decorate(handler: Handler) -> Handler:
        @csrf_exempt
        @functools.wraps(handler)
        def view(request: HttpRequest, **kwargs: Any) -> HttpResponse:
            try:
                if request.method not in methods:
                    raise ApiError(
                        f"{request.method} is not allowed here",
                        code="method_not_allowed",
                        status_code=405,
                    )
                scope = "read" if request.method == "GET" else "write"
                result = handler(request, _principal(request, scope), **kwargs)
            except ApiError as exc:
                return error_response(exc)
            if isinstance(result, HttpResponse):
                return result
            if result is None:
                return HttpResponse(status=204)
            return JsonResponse(result, safe=False)

        return view

    return decorate


@endpoint("GET", "POST")
def sandboxes(request: HttpRequest, principal: Principal) -> Any:
    """GET /v2/sandboxes (list) and POST /v2/sandboxes (create)."""
    if request.method == "GET":
        found, next_token = services.e2b_sandbox_list(
            principal=principal,
            metadata=request.GET.get("metadata"),
            state=request.GET.get("state"),
            limit=request.GET.get("limit"),
            next_token=request.GET.get("nextToken"),
            order=request.GET.get("order"),
            template=request.GET.get("template"),
            started_after=request.GET.get("startedAfter"),
        )
        listed = JsonResponse([services.sandbox_listed_view(s) for s in found], safe=False)
        if next_token is not None:
            listed["X-Next-Token"] = next_token  # the SDK's paginator reads it
        return listed
    sandbox = services.e2b_sandbox_create(
        principal=principal,
        data=_body(request),
        idempotency_key=request.headers.get("Idempotency-Key"),
    )
    return JsonResponse(services.sandbox_created_view(sandbox, principal=principal), status=201)


@endpoint("GET", "DELETE")
def sandbox_detail(request: HttpRequest, principal: Principal, sandbox_id: str) -> Any:
    if request.method == "DELETE":
        services.e2b_sandbox_kill(principal=principal, sandbox_id=sandbox_id)
        return None
    sandbox = services.e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    return services.sandbox_detail_view(sandbox, principal=principal)


@endpoint("POST")
def sandbox_timeout(request: HttpRequest, principal: Principal, sandbox_id: str) -> Any:
    services.e2b_sandbox_set_timeout(
        principal=principal, sandbox_id=sandbox_id, timeout=_body(request).get("timeout")
    )
    return None


@endpoint("POST")
def sandbox_connect(request: HttpRequest, principal: Principal, sandbox_id: str) -> Any:
    """Connecting to a sandbox (extending its timeout when one is given): a running one
    at once (200), a paused one resumed from its files first (201; apps/e2b/pausing.py).
    Also E2B's older ``POST /sandboxes/{id}/resume``."""
    data = _body(request)
    timeout = data.get("timeout")
    resumed = pausing.e2b_sandbox_connect(principal=principal, sandbox_id=sandbox_id, data=data)
    sandbox = services.e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    if timeout is not None:
        services.e2b_sandbox_set_timeout(
            principal=principal, sandbox_id=sandbox_id, timeout=timeout
        )
    view = services.sandbox_created_view(sandbox, principal=principal)
    return JsonResponse(view, status=201) if resumed else view


@endpoint("POST")
def sandbox_pause(request: HttpRequest, principal: Principal, sandbox_id: str) -> Any:
    """E2B's pause: a ``filesystem`` pause (files kept, compute released); 409 when
    already paused, as E2B answers (the SDK then returns False)."""
    paused = pausing.e2b_sandbox_pause(
        principal=principal, sandbox_id=sandbox_id, data=_body(request)
    )
    if not paused:
        raise ApiError("the sandbox is already paused", code="conflict", status_code=409)
    return None


@endpoint("POST")
def not_yet(request: HttpRequest, principal: Principal, sandbox_id: str, **kwargs: Any) -> Any:
    """E2B's snapshots and forks: a typed 501 (Hedgerow's own snapshot and fork API
    is not wired to E2B's yet). Another tenant's sandbox is still not found first."""
    services.e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    raise ApiError(
        "E2B's snapshots and forks are not served here yet: use Hedgerow's snapshot and "
        "fork API (docs/snapshots.md)",
        code="not_implemented",
        status_code=501,
    )


def not_found(request: HttpRequest, path: str = "") -> JsonResponse:
    return error_response(ApiError("not found", code="not_found", status_code=404))
