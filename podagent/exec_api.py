"""POST /exec, GET /operations/{id}, POST /operations/{id}/cancel."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from typing import Any, Callable, Dict, List, Optional

from .errors import ApiError, bad_request
from .operations import Frame, Operation, Registry
from .runner import ExecSpec, StdinClosed, StdinFeed, StdinFull, StdinOffset, run

OP_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")
MAX_WINDOW = 64 * 1024 * 1024
DEFAULT_WINDOW = 1024 * 1024
ATTACH_POLL_S = 5.0

Emit = Callable[[bytes], None]


class ExecRequest:
    def __init__(self, op_id: str, spec: ExecSpec, stream: bool, fingerprint: str) -> None:
        self.op_id = op_id
        self.spec = spec
        self.stream = stream
        self.fingerprint = fingerprint


def _number(body: Dict[str, Any], key: str, default: Optional[float]) -> Optional[float]:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise bad_request(f"{key} must be a non-negative number", key)
    return float(value)


def _int(body: Dict[str, Any], key: str, default: Optional[int]) -> Optional[int]:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{key} must be a non-negative integer", key)
    return int(value)


def parse_exec(body: Any, base_env: Dict[str, str], shell: str, workdir: str) -> ExecRequest:
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    op_id = body.get("operation_id")
    if not isinstance(op_id, str) or not OP_ID_RE.match(op_id):
        raise bad_request("operation_id must match [A-Za-z0-9._:-]{1,128}", "operation_id")
    command = body.get("command")
    login_shell = body.get("login_shell", False)
    if not isinstance(login_shell, bool):
        raise bad_request("login_shell must be a boolean", "login_shell")
    argv: List[str]
    if isinstance(command, str) and command:
        if os.path.basename(shell) == "bash":
            argv = [shell, "-lc" if login_shell else "-c", command]
        else:
            argv = [shell, "-c", command]
    elif isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        argv = list(command)
    else:
        raise bad_request("command must be a non-empty string or list of strings", "command")
    cwd = body.get("cwd")
    if cwd is None:
        cwd = workdir
    elif not isinstance(cwd, str) or not cwd or "\0" in cwd:
        raise bad_request("cwd must be a path", "cwd")
    cwd = os.path.join(workdir, cwd)
    env = body.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise bad_request("env must map names to string values", "env")
    stdin_raw = body.get("stdin")
    stdin: Optional[bytes] = None
    if stdin_raw is not None:
        if not isinstance(stdin_raw, str):
            raise bad_request("stdin must be base64 or null", "stdin")
        try:
            stdin = base64.b64decode(stdin_raw, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("stdin is not valid base64", "stdin") from None
    stdin_open = body.get("stdin_open", False)
    if not isinstance(stdin_open, bool):
        raise bad_request("stdin_open must be a boolean", "stdin_open")
    timeout = _number(body, "timeout", None)
    kill_grace = _number(body, "kill_grace", 2.0)
    window = _int(body, "output_window", DEFAULT_WINDOW)
    if window is None or window < 2 or window > MAX_WINDOW:
        raise bad_request(f"output_window must be in [2, {MAX_WINDOW}]", "output_window")
    limit = _int(body, "output_limit", None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    full_env = dict(base_env)
    full_env.update(env)
    fields: List[Any] = [command, cwd, env, stdin_raw, login_shell]
    if stdin_open:
        fields.append("stdin_open")
    identity = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    spec = ExecSpec(
        argv, cwd, full_env, stdin, timeout, kill_grace or 0.0, window, limit, stdin_open
    )
    return ExecRequest(op_id, spec, stream, hashlib.sha256(identity.encode()).hexdigest())


def encode_frame(op: Operation, frame: Frame, replayed: bool = False) -> bytes:
    seq, kind, payload = frame
    obj: Dict[str, Any]
    if kind == "start":
        obj = {"seq": seq, "type": "start", "operation_id": op.op_id, "pid": payload}
    elif kind == "exit":
        obj = {"seq": seq, "type": "exit", "result": dict(payload, replayed=replayed)}
    else:
        obj = {"seq": seq, "type": kind, "data": base64.b64encode(payload).decode("ascii")}
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class ExecService:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def claim(self, req: ExecRequest) -> "tuple[Operation, bool]":
        op = self.registry.get(req.op_id)
        if op is None:
            if not os.path.isdir(req.spec.cwd):
                raise ApiError(
                    400, "cwd_not_found", f"cwd {req.spec.cwd} is not a directory", "cwd"
                )
            op, created = self.registry.claim(req.op_id, req.fingerprint, req.spec.kill_grace)
            if created and req.spec.stdin_open:
                # Before the command starts, so input sent at once is never refused.
                op.control.stdin = StdinFeed(req.spec.stdin or b"")
        else:
            created = False
        if not created and op.fingerprint != req.fingerprint:
            raise ApiError(
                409, "operation_conflict", f"operation {req.op_id} exists with a different body"
            )
        return op, created

    def execute(
        self,
        op: Operation,
        req: ExecRequest,
        emit: Optional[Emit],
        on_spawn: Optional[Callable[[], None]] = None,
    ) -> Dict[str, Any]:
        """Run the claimed operation on this thread; emit frames as they happen.
        `on_spawn` runs once the command was started (or failed to start): work
        there overlaps the command's own start-up instead of delaying it."""
        sink: List[Optional[Emit]] = [emit]

        def send(frame: Frame) -> None:
            out = sink[0]
            if out is None:
                return
            try:
                out(encode_frame(op, frame))
            except OSError:
                # The client went away: the command keeps running so a replay
                # can still collect its result.
                sink[0] = None

        def on_start(pid: Optional[int]) -> None:
            send(op.record("start", pid))
            if on_spawn is not None:
                on_spawn()

        def on_output(kind: str, data: bytes) -> None:
            send(op.record(kind, data))

        try:
            result = run(req.spec, op.control, on_start, on_output)
        except Exception as exc:  # noqa: BLE001 - the op must always finish
            result = {
                "termination": {
                    "reason": "agent_error",
                    "exit_code": None,
                    "signal": None,
                    "message": f"agent error: {exc!r}",
                },
                "stdout": None,
                "stderr": None,
                "usage": None,
                "children_remained": False,
            }
        full: Dict[str, Any] = {"operation_id": op.op_id, "status": "completed"}
        full.update(result)
        full["replayed"] = False
        send(op.finish(full))
        return full

    def stream_attached(self, op: Operation, emit: Emit) -> None:
        """Send every frame of `op` from the oldest held, then the live tail."""
        if not op.attach():
            result = op.result
            assert result is not None
            emit(encode_frame(op, (0, "start", op.control.pid)))
            emit(encode_frame(op, (1, "exit", result), replayed=True))
            return
        try:
            seq = 0
            while True:
                frames, done = op.frames_after(seq, ATTACH_POLL_S)
                for frame in frames:
                    emit(encode_frame(op, frame, replayed=True))
                    seq = frame[0] + 1
                if done:
                    return
        finally:
            op.detach()


STDIN_WAIT_S = 10.0  # how long a sender waits for room in a full stdin buffer


def send_stdin(op: Operation, body: Any) -> Dict[str, Any]:
    """``POST /operations/{id}/stdin``: ``{"data": base64, "eof": bool, "wait": s,
    "offset": n}`` →
    input for a running command started with ``stdin_open``; ``eof`` closes its stdin
    once the data is written; ``wait`` (default and at most 10 s) is how long to wait
    for room when the buffer is full. 409 ``stdin_closed`` when it takes no input
    (never opened, closed, ended), 429 ``stdin_full`` when the command has not read
    what it was sent."""
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    raw = body.get("data", "")
    if not isinstance(raw, str):
        raise bad_request("data must be base64", "data")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("data is not valid base64", "data") from None
    eof = body.get("eof", False)
    if not isinstance(eof, bool):
        raise bad_request("eof must be a boolean", "eof")
    wait = _number(body, "wait", STDIN_WAIT_S)
    assert wait is not None
    offset = _int(body, "offset", None)
    feed = op.control.stdin
    if feed is None:
        raise ApiError(409, "stdin_closed", "this command was not started with stdin_open", "stdin")
    if op.result is not None and (data or not eof):  # closing again is still fine
        raise ApiError(409, "stdin_closed", "the command has ended", "stdin")
    try:
        waiting, received = feed.send(data, eof, min(wait, STDIN_WAIT_S), offset)
    except StdinOffset as exc:
        raise ApiError(409, "stdin_offset", str(exc), "offset") from None
    except StdinClosed as exc:
        raise ApiError(409, "stdin_closed", str(exc), "stdin") from None
    except StdinFull as exc:
        raise ApiError(429, "stdin_full", str(exc), "stdin") from None
    return {
        "operation_id": op.op_id,
        "accepted": len(data),
        "buffered": waiting,
        "offset": received,
        "eof": eof,
    }
