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


class HedgerowConnectionError(HedgerowError):
    """The server could not be reached (``connection_error``): its message says where
    the SDK looked and what to check."""


class LocalPathError(HedgerowError):
    """A local path an upload or download needs is missing or unusable."""


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
    """``sandbox_lost``: the sandbox vanished under the server (its host or process
    died); not something a client did."""


class SandboxDeleted(SandboxNotReady):
    """``sandbox_deleted``: the sandbox was deleted (by a client, its TTL, its
    heartbeat timeout or an operator); ``reason`` says which when the server gave one."""

    @property
    def reason(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        value = err.get("reason") if isinstance(err, dict) else None
        return str(value) if value else None


class AgentUnreachable(HedgerowError):
    pass


class WaitTimeout(HedgerowError):
    pass


class ImageUnavailable(ValidationError):
    """The image cannot be had (a 422, or 400 for a bad reference); ``code`` says why
    (image_not_found, registry_unauthorized, registry_unreachable, registry_forbidden,
    image_digest_mismatch, …) and ``reference`` which image."""

    @property
    def reference(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return str(err["reference"]) if isinstance(err, dict) and "reference" in err else None


class InvalidImageReference(ImageUnavailable):
    """``image_reference_invalid`` (400): not an OCI reference."""


class ImageInUse(Conflict):
    """``image_in_use`` (409): a live sandbox runs the image."""


class DiskExhausted(HedgerowError):
    """``disk_exhausted`` (507): the image store has no room for the image."""


class SnapshotFailed(HedgerowError):
    """A capture that did not complete (``code``: ``sandbox_not_running``,
    ``sandbox_busy``, ``probe_failed``, ``snapshot_failed``): nothing was kept."""


IMAGE_ERROR_CODES = (
    "unknown_image",
    "image_not_found",
    "registry_unauthorized",
    "registry_unreachable",
    "registry_forbidden",
    "image_digest_mismatch",
    "image_platform_unsupported",
    "image_layer_refused",
    "image_archive_invalid",
    "image_user_unknown",
    "image_store_error",
)

_BY_CODE = {
    **dict.fromkeys(IMAGE_ERROR_CODES, ImageUnavailable),
    "image_reference_invalid": InvalidImageReference,
    "image_in_use": ImageInUse,
    "disk_exhausted": DiskExhausted,
    "sandbox_not_ready": SandboxNotReady,
    "sandbox_terminating": SandboxTerminating,
    "sandbox_lost": SandboxLost,
    "sandbox_failed": SandboxNotReady,
    "sandbox_deleted": SandboxDeleted,
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
