"""Orchard jobs are Hedgerow operations.

A job starts through the streamed-exec service (``operation_exec_stream``): the
command runs in the agent at once, a relay records its typed result on the
operation row, and the row is the job. Waiting is event-driven on the operation's
replay stream, and every read goes through ``operation_recover`` first, so a job
whose relay died is collected from the agent by operation id: a finished job is never
reported ``running`` and a command never runs twice.
"""

from __future__ import annotations

import shlex
import time
import uuid
from typing import Any

from django.conf import settings

from apps.core.errors import NotFound, ValidationFailed
from apps.core.redis_sync import redis_client
from apps.sandboxes.api.serializers import render_stream
from apps.sandboxes.models import Operation, OperationStatus, Sandbox
from apps.sandboxes.services.operations import ExecRequest
from apps.sandboxes.services.streaming import (
    buffer_last_seq,
    frames_key,
    operation_exec_stream,
    operation_recover,
)
from apps.tenancy.models import Tenant
from apps.tenancy.principal import Principal

MAX_EXEC_TIMEOUT_S = 86400.0
TIMEOUT_EXIT_CODE = 124  # what `timeout(1)` and Orchard clients expect for a timeout
RECOVER_EVERY_S = 5.0


def command_text(command: Any) -> str:
    """A list is quoted argument by argument, so ``["echo", "a b"]`` prints ``a b``."""
    if isinstance(command, str):
        if not command.strip():
            raise ValidationFailed("command is empty", field="command")
        return command
    if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        return shlex.join(command)
    raise ValidationFailed(
        "command must be a string or a non-empty list of strings", field="command"
    )


def _timeout(value: Any) -> float:
    if value is None:
        return float(settings.HEDGEROW_EXEC_DEFAULT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValidationFailed("timeout_seconds must be a positive number", field="timeout_seconds")
    return min(float(value), MAX_EXEC_TIMEOUT_S)


def exec_request(data: dict[str, Any]) -> ExecRequest:
    """Validates an Orchard exec body (``command``, ``timeout_seconds``, ``cwd``,
    ``env``, ``login_shell``) into the Hedgerow exec request."""
    cwd = data.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise ValidationFailed("cwd must be an absolute path", field="cwd")
    env = data.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValidationFailed("env must map strings to strings", field="env")
    login_shell = data.get("login_shell", False)
    if not isinstance(login_shell, bool):
        raise ValidationFailed("login_shell must be true or false", field="login_shell")
    request = ExecRequest(
        command=command_text(data.get("command")),
        cwd=cwd,
        env=env,
        timeout=_timeout(data.get("timeout_seconds")),
        login_shell=login_shell,
    )
    request.check()  # a NUL in the command, env or cwd: 400 before anything runs
    return request


def job_submit(*, principal: Principal, sandbox: Sandbox, request: ExecRequest) -> Operation:
    """Starts the command and returns its operation at once (``running``). Raises the
    exec service's typed errors (sandbox not ready, agent unreachable, …)."""
    operation, _ = operation_exec_stream(
        principal=principal,
        sandbox=sandbox,
        request=request,
        operation_id=f"orchard-{uuid.uuid4().hex}",
    )
    return operation


def job_get(*, tenant: Tenant, job_id: str) -> Operation:
    """The tenant's operation with this job id (another tenant's is a 404)."""
    try:
        pk = uuid.UUID(job_id)
    except ValueError:
        raise NotFound(f"no job {job_id!r}", code="job_not_found") from None
    operation = Operation.objects.for_tenant(tenant).select_related("sandbox").filter(pk=pk).first()
    if operation is None:
        raise NotFound(f"no job {job_id!r}", code="job_not_found")
    return job_refresh(operation)


def job_refresh(operation: Operation) -> Operation:
    """Re-reads the row; a running row whose relay died is collected from the agent."""
    operation.refresh_from_db()
    if operation.status == OperationStatus.RUNNING:
        operation = operation_recover(operation=operation)
    return operation


def job_wait(*, operation: Operation, timeout_s: float) -> Operation:
    """Blocks until the job ends or ``timeout_s`` passes, waking on the operation's
    frames (the exit frame is appended only after the row is final)."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    key = frames_key(str(operation.pk))
    last_id = "0-0"
    next_recover = time.monotonic() + RECOVER_EVERY_S
    client = redis_client()
    while True:
        operation.refresh_from_db()
        if operation.status != OperationStatus.RUNNING:
            return operation
        now = time.monotonic()
        if now >= next_recover:
            operation = operation_recover(operation=operation)
            next_recover = now + RECOVER_EVERY_S
            if operation.status != OperationStatus.RUNNING:
                return operation
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return operation
        block_ms = max(int(min(remaining, RECOVER_EVERY_S) * 1000), 1)
        entries: Any = client.xread({key: last_id}, block=block_ms, count=1000)
        if entries:
            last_id = entries[0][1][-1][0]


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return float(value.timestamp())


def job_view(operation: Operation) -> dict[str, Any]:
    """The Orchard job shape, plus Hedgerow's typed end (``termination``, ``signal``,
    ``timed_out``, truncation) for clients that read more."""
    usage = operation.usage or {}
    request = operation.request or {}
    finished = operation.status != OperationStatus.RUNNING
    exit_code: int | None = None
    error: str | None = None
    if not finished:
        started = buffer_last_seq(str(operation.pk)) >= 0
        status = "running" if started else "queued"
    else:
        reason = operation.termination
        if reason == "exited":
            exit_code = operation.exit_code
        elif reason == "timeout":
            exit_code = TIMEOUT_EXIT_CODE
            error = f"timeout: the command ran longer than {request.get('timeout')}s and was killed"
        elif reason == "signaled" and operation.signal is not None:
            exit_code = -int(operation.signal)
            error = f"killed by signal {operation.signal}"
        elif reason in ("output_limit", "cancelled"):
            exit_code = -int(operation.signal) if operation.signal else -1
            error = reason
        else:
            exit_code = -1
            err = operation.error or {}
            error = f"{err.get('code', 'error')}: {err.get('message') or 'the command failed'}"
        exhausted = operation.error or {}
        if exhausted.get("code") == "resource_exhausted":
            # named, whatever the exit: the sandbox's own limit ended or crippled it
            error = f"resource_exhausted ({exhausted.get('kind')}): {exhausted.get('message')}"
        succeeded = reason == "exited" and exit_code == 0
        status = (
            "succeeded" if succeeded and operation.status != OperationStatus.FAILED else "failed"
        )
    stdout, stderr = operation.stdout or {}, operation.stderr or {}
    return {
        "job_id": str(operation.pk),
        "sandbox_id": operation.sandbox.external_id,
        "command": request.get("command"),
        "status": status,
        "stdout": render_stream(stdout),
        "stderr": render_stream(stderr),
        "exit_code": exit_code,
        "error": error,
        "created_at": operation.created_at.timestamp(),
        "started_at": _epoch(usage.get("started_at"))
        or (operation.created_at.timestamp() if status != "queued" else None),
        "completed_at": _epoch(usage.get("ended_at")) or _epoch(operation.finished_at),
        "operation_id": operation.operation_id,
        "termination": operation.termination or None,
        "signal": operation.signal,
        "timed_out": operation.termination == "timeout",
        "truncated": bool(stdout.get("truncated") or stderr.get("truncated")),
        "stdout_bytes": stdout.get("total_bytes"),
        "stderr_bytes": stderr.get("total_bytes"),
        "resource_exhausted": _exhausted(operation),
    }


def _exhausted(operation: Operation) -> dict[str, Any] | None:
    """``{"kind", "limit"}`` when the sandbox's limit (memory, pids, …) ended the job."""
    error = operation.error or {}
    if error.get("code") != "resource_exhausted":
        return None
    return {"kind": error.get("kind"), "limit": error.get("limit")}
