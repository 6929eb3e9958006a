"""Typed API errors: every failure the agent reports has a stable code."""

from __future__ import annotations

from typing import Any, Dict, Optional


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field

    def body(self) -> Dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}


def bad_request(message: str, field: Optional[str] = None) -> ApiError:
    return ApiError(400, "bad_request", message, field)
