"""Typed errors carrying the server's error code and message."""

from __future__ import annotations

from typing import Any


class HedgerowError(Exception):
    def __init__(
        self,
        message: str,
        *,
        code: str = "error",
        status: int = 0,
        field: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.message = message
        self.code = code
        self.status = status
        self.field = field
        self.body = body or {}


class AuthError(HedgerowError):
    pass


class NotFound(HedgerowError):
    pass


class Conflict(HedgerowError):
    pass


class ValidationError(HedgerowError):
    pass


class QuotaExceeded(HedgerowError):
    pass


class BudgetExhausted(HedgerowError):
    pass


class SandboxNotReady(Conflict):
    pass


class SandboxTerminating(SandboxNotReady):
    pass


class SandboxLost(SandboxNotReady):
    pass


class AgentUnreachable(HedgerowError):
    pass


class WaitTimeout(HedgerowError):
    pass


_BY_CODE = {
    "sandbox_not_ready": SandboxNotReady,
    "sandbox_terminating": SandboxTerminating,
    "sandbox_lost": SandboxLost,
    "sandbox_failed": SandboxNotReady,
    "sandbox_deleted": SandboxNotReady,
    "budget_exhausted": BudgetExhausted,
    "quota_exceeded": QuotaExceeded,
    "agent_unreachable": AgentUnreachable,
    "wait_timeout": WaitTimeout,
}
_BY_STATUS = {401: AuthError, 403: AuthError, 404: NotFound, 409: Conflict, 429: QuotaExceeded}


def error_from_response(status: int, body: Any, text: str = "") -> HedgerowError:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"code": "http_%d" % status, "message": text[:500] or "HTTP %d" % status}
    code = str(err.get("code", "error"))
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status)
    if cls is None:
        cls = ValidationError if status == 400 else HedgerowError
    return cls(
        str(err.get("message", "")),
        code=code,
        status=status,
        field=err.get("field"),
        body=body if isinstance(body, dict) else None,
    )
