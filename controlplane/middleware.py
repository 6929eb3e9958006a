from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

from apps.core.logging import request_id_var

access_log = logging.getLogger("hedgerow.access")
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestIdMiddleware:
    """Accepts a sane ``X-Request-Id`` or makes one; it follows the request into
    Celery tasks and the pod agent's log lines."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        incoming = request.headers.get("X-Request-Id", "")
        request_id = incoming if _VALID_REQUEST_ID.match(incoming) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        try:
            response = self.get_response(request)
            # One structured line per request, under its id: the web end of a trace.
            access_log.info(
                "%s %s %s",
                request.method,
                request.path,
                response.status_code,
                extra={
                    "event": "request",
                    "method": request.method,
                    "path": request.path,
                    "status": response.status_code,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                },
            )
        finally:
            request_id_var.reset(token)
        response["X-Request-Id"] = request_id
        return response


class InputGuardMiddleware:
    """NUL in the URL path or a query parameter is a typed 400 before any view runs:
    Postgres cannot hold it and the agent refuses it, so it used to be a 500 wherever a
    filter or an id reached a query (apps/core/inputs.py has the JSON side)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        field = _nul_field(request)
        if field is None:
            return self.get_response(request)
        message = f"{field} contains a NUL byte"
        if request.path.startswith("/orchard/"):
            return JsonResponse({"detail": message, "code": "invalid_text"}, status=400)
        body = {"error": {"code": "invalid_text", "message": message, "field": field}}
        return JsonResponse(body, status=400)


def _nul_field(request: HttpRequest) -> str | None:
    if "\x00" in request.path:
        return "path"
    for key, values in request.GET.lists():
        if "\x00" in key or any("\x00" in value for value in values):
            return key.replace("\x00", "\\0")
    return None
