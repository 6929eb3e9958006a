"""Streamed exec: the web process pumps the agent's NDJSON frames into a bounded
replay buffer (a Redis stream per operation) and a Channels group per operation.

Why a Redis stream *and* a group: the stream is the source of truth that late or
reconnecting subscribers replay from (entry id ``0-<seq+1>``, so ranges by seq are
exact), while the group wakes live subscribers without polling. channels_redis may
drop group messages when a subscriber's channel is full, so subscribers detect a
jump in ``seq`` and fill it from the stream: nothing is lost or sent twice.

A pump advertises itself with an expiring Redis key (refreshed by one heartbeat
thread per process). When no pump is alive for a ``running`` operation, the
operation is recovered from the agent by operation id (``operation_recover``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction

from apps.billing.limits import ExecLease
from apps.core.redis_sync import redis_client
from apps.sandboxes.agent_client import AgentClient, AgentError, AgentUnreachable
from apps.sandboxes.models import Operation, OperationStatus, State
from apps.sandboxes.services import replay
from apps.sandboxes.services.operations import (
    ExecRequest,
    _agent_timeout,
    agent_for,
    operation_admit,
    operation_begin,
    operation_record_failure,
    operation_record_result,
    request_from_record,
)
from apps.sandboxes.services.replay import frames_key as frames_key
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)

PUMP_TTL_S = 15
HEARTBEAT_INTERVAL_S = 5.0
REATTACH_ATTEMPTS = 3


def pump_key(operation_pk: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}oppump:{operation_pk}"


def operation_group(operation_pk: str) -> str:
    return f"op.{uuid.UUID(str(operation_pk)).hex}"


def client_frame(agent_frame: dict[str, Any]) -> dict[str, Any]:
    """Agent NDJSON frame → the websocket frame shape (without ids, added per subscriber)."""
    kind = agent_frame.get("type")
    frame: dict[str, Any] = {"type": f"exec.{kind}", "seq": int(agent_frame["seq"])}
    if kind in ("stdout", "stderr"):
        frame["data"] = agent_frame.get("data", "")
    elif kind == "start":
        frame["pid"] = agent_frame.get("pid")
    return frame


# -- pump liveness --------------------------------------------------------------
class _PumpRegistry:
    """The pumps this process runs; one daemon thread keeps their Redis keys alive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self.owner = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def claim(self, operation_pk: str) -> bool:
        """Takes the pump role for an operation; False when another pump holds it."""
        key = pump_key(operation_pk)
        if not redis_client().set(key, self.owner, nx=True, ex=PUMP_TTL_S):
            return False
        self.track(operation_pk)
        return True

    def track(self, operation_pk: str) -> None:
        """Keeps an already claimed key alive (the async exec path claims it with
        ``SET key owner NX EX PUMP_TTL_S`` in its own Redis round trip)."""
        key = pump_key(operation_pk)
        with self._lock:
            self._keys[key] = self.owner
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._beat, name="hedgerow-pump-heartbeat", daemon=True
                )
                self._thread.start()

    def release(self, operation_pk: str, *, delete: bool = True) -> None:
        key = pump_key(operation_pk)
        with self._lock:
            self._keys.pop(key, None)
        if delete:
            try:
                client = redis_client()
                if client.get(key) == self.owner.encode():
                    client.delete(key)
            except redis.RedisError:
                log.warning("could not release pump key", extra={"key": key})

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            with self._lock:
                keys = list(self._keys)
            if not keys:
                continue
            try:
                pipe = redis_client().pipeline(transaction=False)
                for key in keys:
                    pipe.set(key, self.owner, xx=True, ex=PUMP_TTL_S)
                pipe.execute()
            except redis.RedisError:
                log.warning("pump heartbeat failed")


pumps = _PumpRegistry()


def pump_alive(operation_pk: str) -> bool:
    return bool(redis_client().exists(pump_key(operation_pk)))


# -- the replay buffer ----------------------------------------------------------
def group_message(operation_pk: str, data: str, totals: replay.Totals) -> dict[str, Any]:
    """A stored frame as fanned out to subscribers, with the output totals before and
    after it (a subscriber that missed frames says exactly how much: consumers/feeds.py)."""
    return {"type": "exec.frame", "op": operation_pk, "frame": data, "b": totals[0], "a": totals[1]}


def buffer_append(*, operation_pk: str, frame: dict[str, Any]) -> None:
    """Appends a frame (ids are ``0-<seq+1>``, so duplicates are refused by Redis) and
    wakes the operation's group. Bounded in bytes, frames and time (services/replay.py)."""
    data = json.dumps(frame, separators=(",", ":"))
    totals = replay.append(redis_client(), operation_pk, frame, data)
    if totals is None:
        return  # an id at or below the top: this frame is already stored
    layer = get_channel_layer()
    if layer is not None:
        try:
            async_to_sync(layer.group_send)(
                operation_group(operation_pk), group_message(operation_pk, data, totals)
            )
        except Exception:  # noqa: BLE001 - subscribers fill gaps from the stream
            log.warning("could not fan out exec frame", extra={"operation": operation_pk})


def buffer_last_seq(operation_pk: str) -> int:
    """The highest stored seq, or -1."""
    entries: Any = redis_client().xrevrange(frames_key(operation_pk), count=1)
    if not entries:
        return -1
    return int(entries[0][0].decode().split("-")[1]) - 1


def _push_exit(operation_pk: str) -> None:
    seq = buffer_last_seq(operation_pk) + 1
    buffer_append(operation_pk=operation_pk, frame={"type": "exec.exit", "seq": seq})


# -- starting and pumping -------------------------------------------------------
@dataclass(frozen=True)
class _PumpJob:
    operation_pk: str
    agent: AgentClient
    body: dict[str, Any]
    timeout: float
    lease: ExecLease | None = None  # quotas (billing): the exec slot, freed when it ends
    fresh: bool = False  # a brand-new operation: its buffer is known to be empty
    # started on the event loop (exec_async): the end is recorded through its pool
    on_loop: bool = False


def operation_exec_stream(
    *,
    principal: Principal,
    sandbox: Any,
    request: ExecRequest,
    operation_id: str | None = None,
    expected_generation: int | None = None,
) -> tuple[Operation, bool]:
    """Starts a streamed command and returns at once: (operation, started).

    A new operation is recorded ``running`` and a pump thread in this process relays
    its frames (after commit). A replayed id never runs again: a finished one is
    returned as is, a running one is recovered if its pump died. Raises like
    ``operation_exec`` for a sandbox that is not ready or a conflicting replay.
    """
    operation, is_new = operation_begin(
        principal=principal,
        sandbox=sandbox,
        request=request,
        operation_id=operation_id,
        expected_generation=expected_generation,
    )
    if not is_new:
        if operation.status == OperationStatus.RUNNING:
            operation = operation_recover(operation=operation)
        return operation, False
    lease = operation_admit(
        principal=principal,
        operation=operation,
        is_new=True,
        request=request,
        sandbox_key=str(sandbox.external_id),
    )
    pk = str(operation.pk)
    job = _PumpJob(
        operation_pk=pk,
        agent=agent_for(sandbox),
        body=request.agent_body(operation.operation_id),
        timeout=_agent_timeout(request),
        lease=lease,
        fresh=True,
    )
    transaction.on_commit(lambda: _start_pump(job))
    return operation, True


def _start_pump(job: _PumpJob) -> None:
    """Starts the relay (``stream_pump``: one implementation) on the loop that serves
    this process, or, in a process no loop serves (a Celery worker, a management
    command, recovery's sweep), on a private loop in a thread."""
    from apps.sandboxes.services import stream_pump  # imports this module

    loop = stream_pump.running_loop()
    if loop is not None:
        stream_pump.start_on_loop(loop, job)
        return
    threading.Thread(
        target=stream_pump.run_in_thread,
        args=(job,),
        name=f"hedgerow-pump-{job.operation_pk[:8]}",
        daemon=True,
    ).start()


def record_exit(operation_pk: str, result: dict[str, Any]) -> None:
    operation = Operation.objects.get(pk=operation_pk)
    operation_record_result(operation=operation, result=result)


def finish_failed(operation_pk: str, code: str, message: str, kind: str | None = None) -> None:
    _finish_failed(operation_pk, code, message, kind)


def _finish_with_result(operation_pk: str, result: dict[str, Any], seq: int) -> None:
    record_exit(operation_pk, result)
    # The row is final before the exit frame is visible, so a subscriber that sees
    # exec.exit always reads the finished record.
    buffer_append(operation_pk=operation_pk, frame={"type": "exec.exit", "seq": seq})


def _finish_failed(operation_pk: str, code: str, message: str, kind: str | None = None) -> None:
    operation = Operation.objects.filter(pk=operation_pk).first()
    if operation is None:
        return
    operation_record_failure(operation=operation, code=code, message=message, kind=kind)
    _push_exit(operation_pk)


# -- recovery -------------------------------------------------------------------
def operation_recover(*, operation: Operation) -> Operation:
    """Brings a ``running`` operation whose relay died back to a live or final state.

    Safe to call anytime and from anywhere (API reads, websocket subscribes, a
    reconciler): it does nothing while a pump is alive or the operation is final.
    Otherwise it asks the agent by operation id: a finished result is recorded; a
    running command is re-attached by a new pump in this process (the agent never
    runs it twice); an id the agent does not know, or a sandbox that is gone or
    re-provisioned, ends the operation ``failed``. An unreachable agent leaves it
    ``running`` for a later attempt (the sandbox's own health decides its fate).
    """
    if operation.status != OperationStatus.RUNNING:
        return operation
    pk = str(operation.pk)
    if pump_alive(pk):
        return operation
    sandbox = operation.sandbox
    if sandbox.state != State.READY or sandbox.generation != operation.generation:
        code = "stale_generation" if sandbox.state == State.READY else "sandbox_gone"
        _finish_failed(
            pk, code, f"the sandbox is {sandbox.state} (generation {sandbox.generation})"
        )
        operation.refresh_from_db()
        return operation
    if not pumps.claim(pk):
        return operation
    agent = agent_for(sandbox)
    try:
        result = agent.operation(operation.operation_id, wait=0)
    except AgentUnreachable:
        pumps.release(pk)
        return operation
    except AgentError as exc:
        pumps.release(pk)
        if exc.status == 404:
            _finish_failed(pk, "operation_lost", "the agent no longer knows this operation")
        else:
            _finish_failed(pk, exc.code, exc.message)
        operation.refresh_from_db()
        return operation
    if result.get("status") == "running":
        request = request_from_record(operation.request or {})
        _start_pump(
            _PumpJob(
                operation_pk=pk,
                agent=agent,
                body=request.agent_body(operation.operation_id),
                timeout=_agent_timeout(request),
            )
        )
        return operation
    try:
        _finish_with_result(pk, result, buffer_last_seq(pk) + 1)
    finally:
        pumps.release(pk)
    operation.refresh_from_db()
    return operation
