"""One error shape for the whole API: ``{"error": {"code", "message", "field"}}``."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response


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
        return _first_error(detail[0], prefix)
    code = getattr(detail, "code", "invalid") or "invalid"
    return (prefix or None, str(detail), str(code))


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    # Imported here: rest_framework.views imports the auth classes, which import services
    # that raise these errors.
    from rest_framework.views import exception_handler as drf_exception_handler

    if isinstance(exc, ApiError):
        return Response(exc.as_dict(), status=exc.status_code, headers=exc.headers)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
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
