"""One error shape for the whole API: ``{"error": {"code", "message", "field"}}``."""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response

log = logging.getLogger("hedgerow.errors")


class ApiError(Exception):
    """A typed error raised by services; views turn it into JSON."""

    status_code: int = status.HTTP_400_BAD_REQUEST
    code: str = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
        self.headers = headers or {}
        self.extra = extra or {}

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "field": self.field}
        body.update(self.extra)
        return {"error": body}


class ValidationFailed(ApiError):
    code = "validation_error"


class NotFound(ApiError):
    status_code = status.HTTP_404_NOT_FOUND
    code = "not_found"


class Conflict(ApiError):
    status_code = status.HTTP_409_CONFLICT
    code = "conflict"


class ServiceUnavailable(ApiError):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    code = "unavailable"


def _first_error(detail: Any, prefix: str = "") -> tuple[str | None, str, str]:
    """Flatten DRF's nested validation detail to (field, message, code) of the first error."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            field = f"{prefix}.{key}" if prefix else str(key)
            if key == "non_field_errors":
                field = prefix or ""
            return _first_error(value, field)
    if isinstance(detail, list) and detail:
        # A many=True serializer reports one entry per item, {} for the valid ones: the
        # first error is the first non-empty entry, named by its index ("steps.2.kind").
        for index, item in enumerate(detail):
            if isinstance(item, dict | list):
                if item:
                    return _first_error(item, f"{prefix}.{index}" if prefix else str(index))
                continue
            return _first_error(item, prefix)
    code = getattr(detail, "code", "invalid") or "invalid"
    return (prefix or None, str(detail), str(code))


def _is_transient_outage(exc: Exception) -> bool:
    from django.db import InterfaceError, OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    transient: tuple[type[Exception], ...] = (
        OperationalError,
        InterfaceError,
        RedisConnectionError,
        RedisTimeoutError,
    )
    try:
        from psycopg_pool import PoolTimeout

        transient = (*transient, PoolTimeout)
    except ImportError:  # pragma: no cover - the pool is optional
        pass
    return isinstance(exc, transient)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    # Imported here: rest_framework.views imports the auth classes, which import services
    # that raise these errors.
    from rest_framework.views import exception_handler as drf_exception_handler

    if isinstance(exc, ApiError):
        return Response(exc.as_dict(), status=exc.status_code, headers=exc.headers)
    if _is_transient_outage(exc):
        # The database or Redis is briefly unreachable or saturated: say so with a
        # typed 503 the SDKs retry, instead of an untyped 500.
        outage = ServiceUnavailable(
            "a backing service is briefly unavailable; retry shortly",
            code="service_unavailable",
            headers={"Retry-After": "1"},
        )
        return Response(outage.as_dict(), status=outage.status_code, headers=outage.headers)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        # An unexpected failure: logged with its traceback here (Django never sees it),
        # answered in the envelope with the request id to quote, and no internals.
        from rest_framework.views import set_rollback

        log.error("unhandled error in an API view", exc_info=exc)
        set_rollback()
        return Response(_internal_error_body(), status=status.HTTP_500_INTERNAL_SERVER_ERROR)
    if isinstance(exc, exceptions.ValidationError):
        field, message, code = _first_error(exc.detail)
        body = {
            "error": {
                "code": "validation_error",
                "message": f"{field}: {message}" if field else message,
                "field": field,
                "reason": code,
                "details": exc.detail,
            }
        }
    elif isinstance(exc, exceptions.ParseError):
        body = {"error": {"code": "malformed_request", "message": str(exc.detail), "field": None}}
    elif isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        body = {
            "error": {
                "code": codes if isinstance(codes, str) else str(exc.default_code),
                "message": str(exc.detail),
                "field": None,
            }
        }
    else:  # pragma: no cover - DRF only returns responses for APIException
        return response
    response.data = body
    return response


def _internal_error_body() -> dict[str, Any]:
    from apps.core.logging import request_id_var

    request_id = request_id_var.get()
    message = "internal error" + (f" (request id {request_id})" if request_id else "")
    return {"error": {"code": "internal_error", "message": message, "field": None}}


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """``handler404``: the API's envelope under /api/ (an unknown path is a typed 404
    there too), Orchard's ``{"detail"}`` under /orchard/, Django's page elsewhere."""
    if request.path.startswith("/api/"):
        body = {"error": {"code": "not_found", "message": "no such endpoint", "field": None}}
        return JsonResponse(body, status=404)
    if request.path.startswith("/orchard/"):
        return JsonResponse({"detail": "not found", "code": "not_found"}, status=404)
    return defaults.page_not_found(request, exception or Http404())


def server_error(request: HttpRequest) -> HttpResponse:
    """``handler500``: JSON for API clients (REST, Orchard, E2B), never a traceback
    (DEBUG is off)."""
    if request.path.startswith("/api/"):
        return JsonResponse(_internal_error_body(), status=500)
    if request.path.startswith("/orchard/"):
        return JsonResponse({"detail": "internal error", "code": "internal_error"}, status=500)
    if request.path.startswith("/e2b/"):
        # E2B's {"code": <status>, "message"}: what its SDK reads, on the control plane
        # and (as a plain HTTP error) on envd; the typed envelope beside it.
        body = _internal_error_body()
        return JsonResponse({"code": 500, "message": body["error"]["message"], **body}, status=500)
    return defaults.server_error(request)
