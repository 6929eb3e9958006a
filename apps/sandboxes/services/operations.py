"""Exec on the hot path: web process → pod agent, recorded as an Operation row.

The row is unique per (sandbox, operation_id), so a replayed id finds the stored
result (or attaches to the running command) and never runs the command twice.
"""

from __future__ import annotations

import base64
import logging
import uuid
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, Final, NoReturn
from urllib.parse import quote

from django.conf import settings
from django.db import IntegrityError, connection
from django.utils import timezone

from apps.billing.limits import ExecLease, exec_admit_operation
from apps.core import jsonsafe
from apps.core.errors import ApiError, Conflict, ValidationFailed
from apps.sandboxes import exec_env
from apps.sandboxes.agent_client import AgentClient, AgentError, AgentUnreachable, agent_token
from apps.sandboxes.models import Operation, OperationStatus, Sandbox, SandboxEvent, State
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)


class SandboxNotReady(Conflict):
    code = "sandbox_not_ready"


class AgentUnavailable(ApiError):
    status_code = 502
    code = "agent_unreachable"


@dataclass(frozen=True)
class ExecRequest:
    command: str | list[str]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    stdin_b64: str | None = None
    login_shell: bool = False
    output_window: int | None = None
    output_limit: int | None = None
    kill_grace: float | None = None
    # stdin stays a pipe fed by POST …/operations/{id}/stdin while the command runs
    stdin_open: bool = False

    def fingerprint(self) -> str:
        return _fingerprint(_request_data(self))

    def agent_body(self, operation_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "operation_id": operation_id,
            "command": self.command,
            "login_shell": self.login_shell,
            "env": self.env,
            "timeout": self.timeout,
            "output_window": self.output_window or settings.HEDGEROW_EXEC_OUTPUT_WINDOW,
        }
        if self.cwd is not None:
            body["cwd"] = self.cwd
        if self.stdin_b64 is not None:
            body["stdin"] = self.stdin_b64
        if self.output_limit is not None:
            body["output_limit"] = self.output_limit
        if self.kill_grace is not None:
            body["kill_grace"] = self.kill_grace
        if self.stdin_open:
            body["stdin_open"] = True
        return body

    def check(self) -> None:
        """400 for what no command can carry: a NUL in argv, env or cwd (execve takes
        C strings, and Postgres would refuse to record the request)."""
        jsonsafe.require_no_nul(self.command, "command")
        jsonsafe.require_no_nul(self.env, "env")
        jsonsafe.require_no_nul(self.cwd, "cwd")


# Env values at rest: apps/sandboxes/exec_env.py (names kept, values sealed).
_REQUEST_FIELDS = tuple(f.name for f in dataclass_fields(ExecRequest))


def _request_data(request: ExecRequest) -> dict[str, Any]:
    # Not ``dataclasses.asdict``: its deep copy was a measurable share of an exec's CPU.
    return {name: getattr(request, name) for name in _REQUEST_FIELDS}


def _fingerprint(data: dict[str, Any]) -> str:
    hashed = {name: value for name, value in data.items() if name != "output_window"}
    if not hashed["stdin_open"]:
        del hashed["stdin_open"]  # fingerprints of requests made before it existed
    return exec_env.request_fingerprint(hashed)


def request_record(request: ExecRequest) -> tuple[dict[str, Any], str]:
    """The step "what the Operation row records" for every exec path: (the ``request``
    column, env values sealed; the replay fingerprint, ``ExecRequest.fingerprint``)."""
    data = _request_data(request)
    return exec_env.request_record_fields(data), _fingerprint(data)


def request_from_record(stored: dict[str, Any]) -> ExecRequest:
    """The ExecRequest an Operation row recorded, env values decrypted."""
    allowed = ExecRequest.__dataclass_fields__
    fields = {k: v for k, v in stored.items() if k in allowed}
    if exec_env.ENV_SEALED in stored:
        fields["env"] = exec_env.sealed_env(stored)
    return ExecRequest(**fields)


def end_reason(sandbox: Sandbox) -> str | None:
    """The reason recorded when the sandbox left the live states, or None."""
    reason = (
        SandboxEvent.objects.filter(
            sandbox=sandbox,
            to_state__in=(State.TERMINATING, State.FAILED, State.LOST, State.DELETED),
        )
        .exclude(reason="")
        .order_by("at", "id")
        .values_list("reason", flat=True)
        .first()
    )
    return reason or None


def ensure_ready(sandbox: Sandbox, expected_generation: int | None = None) -> None:
    """Only ``ready`` accepts work; a stale generation is a 409, never a silent retarget."""
    if sandbox.state != State.READY:
        code = "sandbox_terminating" if sandbox.state == State.TERMINATING else None
        extra: dict[str, Any] = {"state": sandbox.state}
        if sandbox.state in (State.DELETED, State.FAILED, State.LOST, State.TERMINATING):
            if sandbox.state != State.TERMINATING:
                code = f"sandbox_{sandbox.state}"
            # Why it ended (client_delete, ttl_expired, heartbeat_timeout, …): the
            # ledger's transition out of the live states (error path only).
            extra["reason"] = end_reason(sandbox)
        raise SandboxNotReady(
            f"sandbox {sandbox.external_id} is {sandbox.state}, not ready",
            code=code,
            extra=extra,
        )
    if expected_generation is not None and expected_generation != sandbox.generation:
        raise Conflict(
            f"sandbox {sandbox.external_id} is at generation {sandbox.generation}, "
            f"not {expected_generation}",
            field="generation",
            code="stale_generation",
            extra={"generation": sandbox.generation},
        )


def agent_for(sandbox: Sandbox) -> AgentClient:
    assert sandbox.endpoint_port is not None
    return AgentClient(
        sandbox.endpoint_host,
        sandbox.endpoint_port,
        agent_token(sandbox.id.hex, sandbox.generation),
    )


def _agent_timeout(request: ExecRequest) -> float:
    command_timeout = (
        request.timeout if request.timeout is not None else settings.HEDGEROW_EXEC_DEFAULT_TIMEOUT_S
    )
    return command_timeout + (request.kill_grace or 2.0) + 15.0


def operation_start(
    *,
    principal: Principal,
    sandbox: Sandbox,
    request: ExecRequest,
    operation_id: str | None,
    kind: str = "exec",
) -> tuple[Operation, bool]:
    """Records the operation (``running``) or finds the replayed one.

    Returns (operation, is_new). A replay with a different body is a 409.
    """
    request.check()
    op_id = operation_id or f"op-{uuid.uuid4().hex}"
    record, fingerprint = request_record(request)
    try:
        operation = Operation.objects.create(
            tenant_id=sandbox.tenant_id,
            sandbox=sandbox,
            operation_id=op_id,
            kind=kind,
            generation=sandbox.generation,
            request=record,
            request_hash=fingerprint,
            actor=principal.actor,
        )
        return operation, True
    except IntegrityError:
        operation = Operation.objects.get(sandbox=sandbox, operation_id=op_id)
        if operation.request_hash != fingerprint:
            raise Conflict(
                f"operation {op_id} was already used with a different request",
                field="operation_id",
                code="operation_conflict",
            ) from None
        return operation, False


RESOURCE_EXHAUSTED = "resource_exhausted"


def resource_exhausted_error(
    exhausted: dict[str, Any], termination: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The stored/answered error of a command its sandbox's limits ended or crippled:
    ``{"code": "resource_exhausted", "kind": memory|pids|disk|…, "limit", "message",
    "signal"}``, from the agent's reading of the cgroup's own counters (never guessed
    from an exit code)."""
    kind = str(exhausted.get("kind") or "unknown")
    error: dict[str, Any] = {
        "code": RESOURCE_EXHAUSTED,
        "message": jsonsafe.text(
            str(exhausted.get("message") or f"the sandbox's {kind} limit was reached")
        ),
        "kind": kind,
        "limit": exhausted.get("limit"),
        "signal": (termination or {}).get("signal"),
    }
    return error


def result_fields(result: dict[str, Any]) -> dict[str, Any]:
    """The Operation fields that store an agent's exec result (finished now). Output
    holding a NUL is stored base64 (``jsonsafe.stream_record``): Postgres's jsonb
    cannot hold ``\\u0000``, and the bytes must survive exactly. A result the agent
    names ``resource_exhausted`` is ``failed`` with that typed error, whatever the exit:
    the command was ended or crippled by its sandbox's limit."""
    termination = result.get("termination") or {}
    reason = str(termination.get("reason", "agent_error"))
    exhausted = result.get(RESOURCE_EXHAUSTED)
    error: dict[str, Any] | None = None
    if isinstance(exhausted, dict):
        error = resource_exhausted_error(exhausted, termination)
    elif reason == "agent_error":
        error = {"code": "agent_error", "message": jsonsafe.text(termination.get("message"))}
    return {
        "status": OperationStatus.COMPLETED if error is None else OperationStatus.FAILED,
        "termination": reason,
        "exit_code": termination.get("exit_code"),
        "signal": termination.get("signal"),
        "stdout": jsonsafe.stream_record(result.get("stdout") or {}),
        "stderr": jsonsafe.stream_record(result.get("stderr") or {}),
        "usage": result.get("usage") or {},
        "children_remained": bool(result.get("children_remained")),
        "error": error,
        "finished_at": timezone.now(),
    }


# The columns an exec's end writes (``result_fields``, ``failure_fields``), in this
# order: the event loop's UPDATE is built from them and the model (exec_async.py).
RESULT_COLUMNS: Final = (
    "status",
    "termination",
    "exit_code",
    "signal",
    "stdout",
    "stderr",
    "usage",
    "children_remained",
    "error",
    "finished_at",
)


def failure_fields(code: str, message: str, kind: str | None = None) -> dict[str, Any]:
    """The Operation fields of an exec that ended without a result: ``failed`` with the
    typed error (``agent_unreachable``, the agent's own code, ``sandbox_terminating``…)."""
    error: dict[str, Any] = {"code": code, "message": jsonsafe.text(message)}
    if kind is not None:
        error["kind"] = kind
    return {
        "status": OperationStatus.FAILED,
        "termination": "agent_error",
        "error": error,
        "finished_at": timezone.now(),
    }


def operation_finish(pk: Any, fields: dict[str, Any]) -> bool:
    """The step "record the end" through the ORM: only a ``running`` row is finished
    (compare-and-set), so a late or duplicate end never overwrites a stored one. True
    when this call finished it. The event loop runs the same update as one prepared
    statement (``exec_async._FINISH_SQL``, built from ``RESULT_COLUMNS``)."""
    return bool(Operation.objects.filter(pk=pk, status=OperationStatus.RUNNING).update(**fields))


def operation_record_result(*, operation: Operation, result: dict[str, Any]) -> Operation:
    """Stores the agent's typed result (``operation_finish``)."""
    fields = result_fields(result)
    if operation_finish(operation.pk, fields):
        # What we wrote is what the row holds: no read-back on the hot path.
        for name, value in fields.items():
            setattr(operation, name, value)
    else:
        operation.refresh_from_db()
    return operation


def operation_record_failure(
    *, operation: Operation, code: str, message: str, kind: str | None = None
) -> Operation:
    operation_finish(operation.pk, failure_fields(code, message, kind))
    operation.refresh_from_db()
    return operation


def operation_begin(
    *,
    principal: Principal,
    sandbox: Sandbox,
    request: ExecRequest,
    operation_id: str | None,
    expected_generation: int | None,
) -> tuple[Operation, bool]:
    """The steps "validate" and "record the row" of an exec through the ORM (streamed
    or not): the sandbox is ``ready`` at the expected generation (409s), the request
    carries no NUL (400), then the ``running`` row or the replayed one (409 on another
    body). The event loop runs both as one statement (``exec_async._START_SQL``) and
    hands every case it does not take (not ready, a replay…) back to this one."""
    ensure_ready(sandbox, expected_generation)
    return operation_start(
        principal=principal, sandbox=sandbox, request=request, operation_id=operation_id
    )


def operation_admit(
    *,
    principal: Principal,
    operation: Operation,
    is_new: bool,
    request: ExecRequest,
    sandbox_key: str,
) -> ExecLease:
    """The step "admit" through the ORM path: the operation's liveness key is claimed
    (so recovery, ``operation_recover``, leaves a command that someone still relays or
    waits for alone), then billing's exec limits (concurrent execs, per key, the rate;
    429s, and a refused new row is removed). A refusal gives the key back: nothing ran.
    The event loop takes the same lease and key in one Redis round trip
    (``exec_async._admit``, billing's ``exec_admit_plan``)."""
    from apps.sandboxes.services.streaming import pumps  # imports this module

    pk = str(operation.pk)
    pumps.claim(pk)
    try:
        return exec_admit_operation(
            principal=principal,
            operation=operation,
            is_new=is_new,
            timeout_s=_agent_timeout(request),
            sandbox_key=sandbox_key,
        )
    except BaseException:
        # Not kept alive forever by the heartbeat thread for a command that never ran.
        pumps.release(pk)
        raise


def operation_exec(
    *,
    principal: Principal,
    sandbox: Sandbox,
    request: ExecRequest,
    operation_id: str | None = None,
    expected_generation: int | None = None,
) -> Operation:
    """Runs a command in a ready sandbox and returns its finished Operation.

    Exactly-once per (sandbox, operation_id): a replay returns the stored result; a
    replay of a running operation attaches to it through the agent (which also keys
    by operation id). Agent validation errors (e.g. ``cwd_not_found``) are stored on
    the operation and raised as 400s; an unreachable agent is a 502 and the operation
    ends ``failed`` — never stuck ``running``.
    """
    operation, is_new = operation_begin(
        principal=principal,
        sandbox=sandbox,
        request=request,
        operation_id=operation_id,
        expected_generation=expected_generation,
    )
    if not is_new and operation.status != OperationStatus.RUNNING:
        from apps.sandboxes.services.recovery import operation_recover_answer

        # A retry after a lost answer: the agent may hold the real result.
        return operation_recover_answer(operation=operation, sandbox=sandbox)
    if operation.generation != sandbox.generation:
        return operation_record_failure(
            operation=operation,
            code="stale_generation",
            message="the sandbox was re-provisioned while this operation ran",
        )
    from apps.sandboxes.services.streaming import pumps  # imports this module

    pk = str(operation.pk)
    lease = operation_admit(
        principal=principal,
        operation=operation,
        is_new=is_new,
        request=request,
        sandbox_key=str(sandbox.external_id),
    )
    agent = agent_for(sandbox)
    if "pool" in connection.settings_dict.get("OPTIONS", {}) and not connection.in_atomic_block:
        # Back to the pool while the command runs (it may take minutes): a thousand
        # concurrent execs must not pin a thousand connections.
        connection.close()
    try:
        result = agent.exec(
            request.agent_body(operation.operation_id), timeout=_agent_timeout(request)
        )
    except (AgentError, AgentUnreachable) as exc:
        operation_agent_failed(sandbox=sandbox, operation=operation, exc=exc)
    finally:
        lease.release()
        # The key expires on its own; deleting it would cost the hot path a round trip.
        pumps.release(pk, delete=False)
    return operation_record_result(operation=operation, result=result)


def operation_agent_failed(
    *, sandbox: Sandbox, operation: Operation, exc: AgentError | AgentUnreachable
) -> NoReturn:
    """Ends a running exec whose agent call failed and raises its API error: 409
    ``sandbox_terminating`` when the sandbox is going away, the agent's own 4xx (e.g.
    ``cwd_not_found``), else 502. The operation is stored ``failed``, never left running."""
    _raise_if_terminating(sandbox, operation)
    if isinstance(exc, AgentError):
        operation_record_failure(
            operation=operation, code=exc.code, message=exc.message, kind=exc.kind
        )
        status = exc.status if 400 <= exc.status < 500 else 502
        if exc.code == RESOURCE_EXHAUSTED:
            # the agent is alive and said why it could not start the command (no
            # thread or process left under the sandbox's limit): retryable, typed
            raise ApiError(
                exc.message,
                code=exc.code,
                status_code=503,
                headers={"Retry-After": "1"},
                extra={"kind": exc.kind, "operation_id": operation.operation_id},
            ) from exc
        raise ApiError(exc.message, code=exc.code, field=exc.field, status_code=status) from exc
    operation_record_failure(operation=operation, code="agent_unreachable", message=str(exc))
    raise AgentUnavailable(
        f"the sandbox's agent did not answer: {exc}",
        extra={"operation_id": operation.operation_id},
    ) from exc


def _raise_if_terminating(sandbox: Sandbox, operation: Operation) -> None:
    """The agent vanished because the sandbox is being deleted: that is the command's
    typed end (409 ``sandbox_terminating``), not an infrastructure error."""
    state = Sandbox.objects.filter(pk=sandbox.pk).values_list("state", flat=True).first()
    if state not in (State.TERMINATING, State.DELETED):
        return
    message = f"sandbox {sandbox.external_id} was deleted while the command ran"
    operation_record_failure(operation=operation, code="sandbox_terminating", message=message)
    raise SandboxNotReady(
        message,
        code="sandbox_terminating",
        extra={"state": state, "operation_id": operation.operation_id},
    )


def operation_cancel(*, operation: Operation) -> bool:
    """Asks the agent to end a running command (SIGTERM, SIGKILL after its kill grace;
    the agent ends its whole session). The command's relay then records the
    ``cancelled`` end as usual. False when the operation had already ended (a finished
    or unknown one is left as it is); a sandbox that is not ready is a 409."""
    if operation.status != OperationStatus.RUNNING:
        return False
    sandbox = operation.sandbox
    ensure_ready(sandbox, operation.generation)
    grace = float((operation.request or {}).get("kill_grace") or 2.0)
    try:
        agent_for(sandbox).request(
            "POST",
            f"/operations/{quote(operation.operation_id, safe='')}/cancel",
            timeout=grace + 15.0,
        )
    except AgentError as exc:
        if exc.status == 404:
            return False
        raise ApiError(exc.message, code=exc.code, status_code=502) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    return True


# One call's input: the agent takes JSON bodies of up to 8 MiB, and holds at most 1 MiB
# a command has not read; a bigger write is several calls.
MAX_STDIN_CHUNK = 1024 * 1024


def operation_send_stdin(
    *, operation: Operation, data: bytes, eof: bool, offset: int | None = None
) -> dict[str, Any]:
    """Input for a running command started with ``stdin_open``, in order; ``eof`` closes
    its stdin after ``data``. 409 ``stdin_closed`` when it takes no input (not started
    with ``stdin_open``, EOF already sent, it closed its stdin, or it ended); 429
    ``stdin_full`` (``Retry-After``) when it has not read what it was sent (the agent
    holds at most 1 MiB); a sandbox that is not ready is a 409 like any exec.
    ``offset``: where ``data`` starts in the command's whole input; a resend of what was
    accepted is not written twice (safe retries), any other mismatch is 409
    ``stdin_offset``."""
    if len(data) > MAX_STDIN_CHUNK:
        raise ValidationFailed(
            f"at most {MAX_STDIN_CHUNK} bytes of input per call", field="data", code="too_large"
        )
    if not (operation.request or {}).get("stdin_open"):
        raise Conflict(
            "this command was not started with stdin_open", code="stdin_closed", field="stdin"
        )
    if operation.status != OperationStatus.RUNNING:
        raise Conflict(
            f"the command has ended ({operation.status})", code="stdin_closed", field="stdin"
        )
    sandbox = operation.sandbox
    ensure_ready(sandbox, operation.generation)
    try:
        response = agent_for(sandbox).request(
            "POST",
            f"/operations/{quote(operation.operation_id, safe='')}/stdin",
            json_body={
                "data": base64.b64encode(data).decode("ascii"),
                "eof": eof,
                **({"offset": offset} if offset is not None else {}),
            },
            timeout=30.0,
        )
    except AgentError as exc:
        if exc.code == "stdin_offset":
            raise Conflict(exc.message, code="stdin_offset", field="offset") from exc
        if exc.status == 404 or exc.code == "stdin_closed":
            message = exc.message if exc.status != 404 else "the command has ended"
            raise Conflict(message, code="stdin_closed", field="stdin") from exc
        if exc.code == "stdin_full":
            raise ApiError(
                exc.message, code="stdin_full", status_code=429, headers={"Retry-After": "1"}
            ) from exc
        raise ApiError(exc.message, code=exc.code, status_code=502) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    answer: dict[str, Any] = response.json()
    return {
        "operation_id": operation.operation_id,
        "accepted": int(answer.get("accepted") or 0),
        "buffered": int(answer.get("buffered") or 0),
        "offset": int(answer.get("offset") or 0),
        "eof": bool(answer.get("eof")),
    }
