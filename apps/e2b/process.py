"""envd's process service on Hedgerow operations.

A command is a streamed exec (``operation_exec_stream``): one operation row like any
REST or Orchard command (typed end, bounded output, operation id, generation), run by
the sandbox's agent over the hot path. The E2B stream is read from the operation's
replay buffer, so a reconnect (``Connect`` by pid) replays the command from its start.
The pid the SDK sees is the command's pid in the sandbox (the agent's start frame),
mapped to its operation in Redis per sandbox.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection

from apps.core.errors import Conflict, ValidationFailed
from apps.core.redis_sync import redis_client
from apps.e2b.connect import ConnectError, envelope
from apps.e2b.services import sandbox_env
from apps.sandboxes.models import Operation, OperationStatus, Sandbox
from apps.sandboxes.services.operations import (
    ExecRequest,
    operation_cancel,
    operation_send_stdin,
)
from apps.sandboxes.services.streaming import frames_key, operation_exec_stream, operation_recover
from apps.tenancy.principal import Principal

# E2B's timeout 0 ("unbounded"): the longest command Hedgerow runs.
UNBOUNDED_TIMEOUT_S = 86400.0
KEEPALIVE_S = 20.0
RECOVER_EVERY_S = 5.0
PID_TTL_S = 86400


def pids_key(sandbox: Sandbox) -> str:
    return pids_key_of(sandbox.pk, sandbox.generation)


def pids_key_of(sandbox_pk: uuid.UUID, generation: int) -> str:
    """The Redis hash of pid → operation for one sandbox generation."""
    return f"{settings.REDIS_KEY_PREFIX}e2b:pids:{sandbox_pk.hex}:{generation}"


def exec_request(
    process: Any,
    *,
    timeout: float | None,
    base_env: dict[str, str] | None = None,
    stdin_open: bool = False,
) -> ExecRequest:
    """envd's ProcessConfig → a Hedgerow exec request. The SDK's ``commands.run``
    sends ``/bin/bash -l -c <cmd>``: that is a login-shell command, as REST's."""
    if not isinstance(process, dict):
        raise ValidationFailed("process is required", field="process")
    cmd, args = process.get("cmd"), process.get("args") or []
    if not isinstance(cmd, str) or not cmd:
        raise ValidationFailed("process.cmd is required", field="process.cmd")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValidationFailed("process.args must be strings", field="process.args")
    envs = process.get("envs") or {}
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise ValidationFailed("process.envs must map strings to strings", field="process.envs")
    cwd = process.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise ValidationFailed("process.cwd must be an absolute path", field="process.cwd")
    command: str | list[str]
    login = False
    if cmd in ("/bin/bash", "bash") and len(args) == 3 and args[:2] == ["-l", "-c"]:
        command, login = args[2], True
    else:
        command = [cmd, *args]
    if isinstance(command, str) and not command.strip():
        raise ValidationFailed("the command is empty", field="process.args")
    request = ExecRequest(
        command=command,
        cwd=cwd or None,
        env={**(base_env or {}), **envs},
        timeout=timeout if timeout else UNBOUNDED_TIMEOUT_S,
        login_shell=login,
        stdin_open=stdin_open,
    )
    request.check()
    return request


def process_start(
    *, principal: Principal, sandbox: Sandbox, data: dict[str, Any], timeout: float | None
) -> Operation:
    """Starts the command (raises the exec service's typed errors before anything runs).
    ``stdin: true`` keeps its stdin open for SendInput / CloseStdin (the agent's
    ``stdin_open``); otherwise stdin is /dev/null, as envd's."""
    stdin = data.get("stdin", False)
    if not isinstance(stdin, bool):
        raise ConnectError("invalid_argument", "stdin must be true or false")
    request = exec_request(
        data.get("process"), timeout=timeout, base_env=sandbox_env(sandbox), stdin_open=stdin
    )
    operation, _ = operation_exec_stream(
        principal=principal,
        sandbox=sandbox,
        request=request,
        operation_id=f"e2b-{uuid.uuid4().hex}",
    )
    return operation


def operation_for_pid(*, sandbox: Sandbox, selector: Any) -> Operation:
    """The operation a ProcessSelector (``{"pid": n}``) names; not_found otherwise."""
    pid = selector.get("pid") if isinstance(selector, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise ConnectError("invalid_argument", "select the process by pid")
    raw: Any = redis_client().hget(pids_key(sandbox), str(pid))
    operation = Operation.objects.filter(sandbox=sandbox, pk=raw.decode()).first() if raw else None
    if operation is None:
        raise ConnectError("not_found", f"process with pid {pid} not found")
    return operation


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return envelope({"event": {kind: body}})


def end_events(operation: Any) -> tuple[bytes | None, ConnectError | None]:
    """The last event of a finished command, or the stream's error (``operation``: the
    row, or anything with its ``termination``, ``exit_code``, ``signal``, ``error`` and
    ``request``)."""
    reason = operation.termination
    if reason == "exited":
        code = int(operation.exit_code or 0)
        return _event(
            "end", {"exitCode": code, "exited": True, "status": f"exit status {code}"}
        ), None
    if reason == "timeout":
        timeout = (operation.request or {}).get("timeout")
        return None, ConnectError(
            "deadline_exceeded",
            f"the command ran longer than its timeout ({timeout}s) and was killed",
        )
    if reason == "signaled":
        signal = operation.signal
        return _event("end", {"exitCode": -1, "exited": False, "status": f"signal: {signal}"}), None
    error = operation.error or {}
    message = f"{error.get('code', reason or 'error')}: {error.get('message') or reason}"
    return _event(
        "end", {"exitCode": -1, "exited": False, "status": reason or "failed", "error": message}
    ), None


def process_events(*, operation: Operation, sandbox: Sandbox) -> Iterator[bytes | ConnectError]:
    """The command's events from its first frame: start (with the pid), stdout and
    stderr as they come, keepalives in silences, and the end (or an error). Wakes on
    the replay buffer; a command whose relay died is collected by ``operation_recover``."""
    key = frames_key(str(operation.pk))
    client = redis_client()
    last_id = "0-0"
    started = False
    last_sent = time.monotonic()
    next_recover = time.monotonic() + RECOVER_EVERY_S
    try:
        while True:
            if not connection.in_atomic_block:
                connection.close()  # not held while blocked (envd._release_db)
            entries: Any = client.xread(
                {key: last_id}, block=int(RECOVER_EVERY_S * 1000), count=500
            )
            for _, items in entries or []:
                for entry_id, fields in items:
                    last_id = entry_id.decode()
                    frame = json.loads(fields[b"f"])
                    kind = frame.get("type")
                    if kind == "exec.start" and not started:
                        started = True
                        pid = int(frame.get("pid") or 0)
                        pipe = client.pipeline(transaction=False)
                        pipe.hset(pids_key(sandbox), str(pid), str(operation.pk))
                        pipe.expire(pids_key(sandbox), PID_TTL_S)
                        pipe.execute()
                        yield _event("start", {"pid": pid})
                    elif kind in ("exec.stdout", "exec.stderr"):
                        if not started:  # a replay whose start frame was dropped
                            started = True
                            yield _event("start", {"pid": 0})
                        yield _event("data", {kind[5:]: frame.get("data", "")})
                    elif kind == "exec.exit":
                        operation.refresh_from_db()
                        if not started:
                            yield _event("start", {"pid": 0})
                        end, error = end_events(operation)
                        if end is not None:
                            yield end
                        if error is not None:
                            yield error
                        return
                    last_sent = time.monotonic()
            now = time.monotonic()
            if now >= next_recover:
                next_recover = now + RECOVER_EVERY_S
                operation = operation_recover(operation=operation)
                operation.refresh_from_db()
                if operation.status != OperationStatus.RUNNING and not client.exists(key):
                    # finished and its buffer expired: the row is the record
                    if not started:
                        yield _event("start", {"pid": 0})
                    end, error = end_events(operation)
                    if end is not None:
                        yield end
                    if error is not None:
                        yield error
                    return
            if now - last_sent >= KEEPALIVE_S and started:
                last_sent = now
                yield _event("keepalive", {})
    finally:
        close_old_connections()


def process_list(*, sandbox: Sandbox) -> list[dict[str, Any]]:
    """The sandbox's running E2B commands (those this layer started and knows the pid of)."""
    mapping: Any = redis_client().hgetall(pids_key(sandbox))
    by_pk = {v.decode(): int(k) for k, v in (mapping or {}).items()}
    running = Operation.objects.filter(
        sandbox=sandbox, pk__in=list(by_pk), status=OperationStatus.RUNNING
    )
    processes = []
    for operation in running:
        request = operation.request or {}
        command = request.get("command")
        if isinstance(command, str):
            cmd, args = "/bin/bash", ["-l", "-c", command]
        else:
            cmd, args = (command or [""])[0], list((command or [""])[1:])
        config: dict[str, Any] = {"cmd": cmd, "args": args, "envs": request.get("env") or {}}
        if request.get("cwd"):
            config["cwd"] = request["cwd"]
        processes.append({"config": config, "pid": by_pk[str(operation.pk)]})
    return processes


def process_signal(*, sandbox: Sandbox, data: dict[str, Any]) -> None:
    """SIGTERM or SIGKILL: the command is cancelled (the agent sends SIGTERM, then
    SIGKILL after the kill grace, to its whole session); its end is recorded on the
    operation (``cancelled``). A command that already ended is not found, as envd."""
    if data.get("signal") not in ("SIGNAL_SIGKILL", "SIGNAL_SIGTERM", 9, 15):
        raise ConnectError("invalid_argument", "signal must be SIGKILL or SIGTERM")
    operation = operation_for_pid(sandbox=sandbox, selector=data.get("process"))
    if not operation_cancel(operation=operation):
        raise ConnectError("not_found", "the process has already ended")


def process_send_input(*, operation: Operation, data: Any, eof: bool = False) -> None:
    """SendInput (``{"stdin": base64}``) or CloseStdin (``eof``) for a command started
    with ``stdin: true``: Hedgerow's ``operation_send_stdin`` (in order, at most 1 MiB
    unread, then resource_exhausted). A command that ended is not found, as envd."""
    raw = b""
    if not eof:
        if not isinstance(data, dict) or not isinstance(data.get("stdin"), str):
            raise ConnectError("invalid_argument", "input.stdin is required")
        try:
            raw = base64.b64decode(data["stdin"], validate=True)
        except (binascii.Error, ValueError):
            raise ConnectError("invalid_argument", "input.stdin is not base64") from None
        if not raw:
            return
    if operation.status != OperationStatus.RUNNING:
        raise ConnectError("not_found", "the process has already ended")
    try:
        operation_send_stdin(operation=operation, data=raw, eof=eof)
    except Conflict as exc:
        operation.refresh_from_db()
        if operation.status != OperationStatus.RUNNING or "ended" in exc.message:
            raise ConnectError("not_found", "the process has already ended") from exc
        raise ConnectError("failed_precondition", exc.message) from exc


def process_stream_input(*, sandbox: Sandbox, messages: list[dict[str, Any]]) -> None:
    """StreamInput (``commands.stream_input``) as a whole body: a start naming the
    process, then its input in order. Calls are answered chunk by chunk in front of
    Django (``apps/e2b/stream_input.py``); this view only sees what that path leaves
    to Django (a Host it would refuse)."""
    if not messages or not isinstance(messages[0].get("start"), dict):
        raise ConnectError("invalid_argument", "the stream must begin with a start event")
    operation = operation_for_pid(sandbox=sandbox, selector=messages[0]["start"].get("process"))
    for message in messages[1:]:
        if "keepalive" in message:
            continue
        data = message.get("data")
        if not isinstance(data, dict):
            raise ConnectError("invalid_argument", "expected a data or keepalive event")
        process_send_input(operation=operation, data=data.get("input"))
