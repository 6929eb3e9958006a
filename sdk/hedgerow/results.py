from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, cast

from hedgerow.shapes import ResourceExhausted


@dataclass(frozen=True)
class StreamInfo:
    total_bytes: int
    sha256: str
    truncated: bool
    head: bytes
    tail: bytes

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> StreamInfo:
        if meta.get("encoding") == "base64":
            head = base64.b64decode(meta.get("head", ""))
            tail = base64.b64decode(meta.get("tail", ""))
        else:
            head = str(meta.get("head", "")).encode()
            tail = str(meta.get("tail", "")).encode()
        return cls(
            total_bytes=int(meta.get("total_bytes", 0)),
            sha256=str(meta.get("sha256", "")),
            truncated=bool(meta.get("truncated", False)),
            head=head,
            tail=tail,
        )


@dataclass(frozen=True)
class ExecError:
    """Why an exec did not run or finish normally (``agent_error``: e.g. the command
    was not found; ``resource_exhausted``: a sandbox limit), from the server's record."""

    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code


@dataclass(frozen=True)
class ExecResult:
    """How a command ended, typed: exactly one of exit_code / signal / timed_out applies
    (``termination`` says which: exited, signaled, timeout, output_limit, agent_error)."""

    operation_id: str
    status: str
    termination: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_info: StreamInfo
    stderr_info: StreamInfo
    usage: dict[str, Any] = field(default_factory=dict)
    children_remained: bool = False
    generation: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def timed_out(self) -> bool:
        """The command's timeout ended it (``termination == "timeout"``)."""
        return self.termination == "timeout"

    @property
    def ok(self) -> bool:
        """It exited 0 by itself, and no sandbox limit ended or crippled it."""
        return self.termination == "exited" and self.exit_code == 0 and not self.resource_exhausted

    @property
    def error(self) -> ExecError | None:
        """The reason the exec failed (``exec(["nosuchcmd"]).error.message`` says the
        command was not found), or None when the command ran."""
        error = self.raw.get("error")
        if isinstance(error, dict) and (error.get("code") or error.get("message")):
            return ExecError(
                code=str(error.get("code") or self.termination or "error"),
                message=str(error.get("message") or ""),
                details=dict(error),
            )
        if isinstance(error, str) and error:
            return ExecError(code=self.termination or "error", message=error)
        return None

    @property
    def resource_exhausted(self) -> ResourceExhausted | None:
        """``{"code": "resource_exhausted", "kind": "memory"|"pids"|…, "limit", …}`` when
        the sandbox's own limit ended or crippled the command, else None."""
        error = self.raw.get("error")
        if isinstance(error, dict) and error.get("code") == "resource_exhausted":
            return cast(ResourceExhausted, error)
        return None

    @classmethod
    def from_api(cls, body: dict[str, Any]) -> ExecResult:
        output = body.get("output") or {}
        return cls(
            operation_id=str(body.get("id")),
            status=str(body.get("status")),
            termination=str(body.get("termination") or ""),
            exit_code=body.get("exit_code"),
            signal=body.get("signal"),
            stdout=str(body.get("stdout", "")),
            stderr=str(body.get("stderr", "")),
            stdout_info=StreamInfo.from_meta(output.get("stdout") or {}),
            stderr_info=StreamInfo.from_meta(output.get("stderr") or {}),
            usage=dict(body.get("usage") or {}),
            children_remained=bool(body.get("children_remained")),
            generation=int(body.get("generation") or 0),
            raw=body,
        )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@dataclass(frozen=True)
class ServerVersion:
    """``GET /api/v1/version``: the server's version, its API version (``v1``) and the
    SDK releases it supports (``sdk_minimum`` … ``sdk_current``)."""

    version: str
    api: str
    sdk_minimum: str
    sdk_current: str
    client: str

    @property
    def compatible(self) -> bool:
        """Whether this SDK is one the server supports (docs/sdk.md: within an API
        version only additions are made, so any release from ``sdk_minimum`` on works)."""
        return _version_tuple(self.client) >= _version_tuple(self.sdk_minimum)

    @classmethod
    def from_api(cls, body: dict[str, Any], client: str) -> ServerVersion:
        sdk = body.get("sdk") or {}
        return cls(
            version=str(body.get("version", "")),
            api=str(body.get("api", "")),
            sdk_minimum=str(sdk.get("minimum", "")),
            sdk_current=str(sdk.get("current", "")),
            client=client,
        )
