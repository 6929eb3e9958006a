"""Exec on the event loop: the REST exec hot path without a thread hop or the ORM.

Only the plain case runs here, in three round trips before the agent call and two
(concurrent) after it:

1. Redis: the quota admission script (same keys and lease as ``exec_admit``) and the
   operation's liveness key, pipelined;
2. Postgres: one statement that checks the sandbox (tenant, ``ready``, generation) and
   INSERTs the ``running`` Operation row — unique (sandbox, operation_id), so a replay
   inserts nothing;
3. the agent call over a pooled keep-alive connection;
4. the result UPDATE (compare-and-set from ``running``) and the lease release.

Anything else — a limits lookup that failed, a refused admission, a
sandbox that is missing, not ready or at another generation, a replayed operation id,
Redis or Postgres trouble before the agent call — returns ``FALLBACK`` having changed
nothing the regular path would see (a taken lease is released), and the caller hands
the request to the regular DRF view, which gives the exact answer (404, 409, 429, the
stored result of a replay…). Once the agent was called, failures are finished here by
the same code the regular path uses (``operation_agent_failed``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final, ParamSpec, TypeVar

import psycopg
import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.utils import timezone

from apps.billing.limits import (
    ExecAdmitPlan,
    ExecLease,
    exec_admit_plan,
    hot_limits,
    hot_limits_cached,
)
from apps.core.pg_async import PgPool, Statement
from apps.core.redis_async import Batches, ReplyError, batches_for_url
from apps.sandboxes.agent_async import agent_exec
from apps.sandboxes.agent_client import AgentClient, AgentError, AgentUnreachable, agent_token
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services.operations import (
    RESULT_COLUMNS,
    ExecRequest,
    _agent_timeout,
    operation_agent_failed,
    operation_finish,
    result_fields,
)
from apps.sandboxes.services.operations import request_record as operation_request_record
from apps.sandboxes.services.streaming import PUMP_TTL_S, _PumpJob, pump_key, pumps
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)

FALLBACK: Final = None
# Connections are held per statement, never across the agent call, so a few serve
# hundreds of concurrent execs.
DB_POOL_MAX = 8

# The start statement's INSERT is built from ``Operation``'s own metadata: the fast
# path sets the columns in ``_START_PARAMS`` and every other column gets the model's
# default, so a column added to the model is written here too (or, with no default,
# fails at import with its name instead of at the first exec). Parameters are sent as
# text (apps/core/pg_async.py), so each carries its type.
_START_PARAMS: Final = {
    "id": "$3::uuid",
    "tenant_id": "$1::uuid",
    "sandbox_id": "s.id",
    "operation_id": "$4::text",
    "kind": "'exec'",
    "generation": "s.generation",
    "request": "$5::jsonb",
    "request_hash": "$6::text",
    "status": "'running'",
    "actor": "$7::text",
    "created_at": "$8::timestamptz",
}


def _sql_default(field: Any) -> str:
    """A column's default as a SQL literal (what Django would have inserted)."""
    if field.has_default():
        value = field.get_default()
        if callable(getattr(field, "default", None)) and not isinstance(value, dict | list):
            raise ValueError(f"Operation.{field.name}: a per-row default needs a fast-path value")
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, dict | list):
            return "'" + json.dumps(value).replace("'", "''") + "'::jsonb"
        if isinstance(value, int):
            return str(value)
        if isinstance(value, str):
            return "'" + value.replace("'", "''") + "'"
        raise ValueError(f"Operation.{field.name}: no SQL literal for default {value!r}")
    if field.null:
        return "NULL"
    if field.blank and field.get_internal_type() in ("CharField", "TextField"):
        return "''"  # Django's default for a blank text column
    raise ValueError(f"Operation.{field.name} has no default: give the fast path a value for it")


def build_start_insert(fields: list[Any], table: str) -> str:
    """``INSERT … SELECT`` for every concrete column of ``fields``."""
    columns = [f.column for f in fields]
    values = [_START_PARAMS.get(f.column) or _sql_default(f) for f in fields]
    return (
        f"INSERT INTO {table} ({', '.join(columns)})\n"  # noqa: S608 - model metadata only
        f"  SELECT {', '.join(values)}\n"
        "  FROM s WHERE $9::bigint IS NULL OR s.generation = $9::bigint\n"
        "  ON CONFLICT (sandbox_id, operation_id) DO NOTHING\n"
        "  RETURNING id"
    )


_START_SQL = f"""
WITH s AS (
  SELECT id, generation, endpoint_host, endpoint_port FROM sandboxes_sandbox
  WHERE tenant_id = $1::uuid AND external_id = $2::text AND state = 'ready'
), ins AS (
  {build_start_insert(list(Operation._meta.concrete_fields), Operation._meta.db_table)}
)
SELECT s.id, s.generation, s.endpoint_host, s.endpoint_port, (SELECT count(*) FROM ins)
FROM s
"""  # noqa: S608 - built from model metadata, no input


def build_finish_update(table: str) -> str:
    """The end's compare-and-set UPDATE of ``RESULT_COLUMNS`` (``operation_finish`` as
    one prepared statement): columns and types from ``Operation``'s metadata, the row's
    id as ``$1``."""
    db = connections["default"]
    sets = ", ".join(
        f"{field.column} = ${n}::{field.db_type(db)}"
        for n, field in enumerate(_RESULT_FIELDS, start=2)
    )
    return f"UPDATE {table} SET {sets}\nWHERE id = $1::uuid AND status = 'running'"  # noqa: S608


_COLUMNS_BY_NAME: Final = {f.name: f for f in Operation._meta.concrete_fields}
_RESULT_FIELDS: Final = [_COLUMNS_BY_NAME[name] for name in RESULT_COLUMNS]
_FINISH_SQL = build_finish_update(Operation._meta.db_table)
_FORGET_SQL = "DELETE FROM sandboxes_operation WHERE id = $1::uuid AND status = 'running'"
_START = Statement(b"hedgerow_exec_start", _START_SQL.encode())
_FINISH = Statement(b"hedgerow_exec_finish", _FINISH_SQL.encode())
_FORGET = Statement(b"hedgerow_exec_forget", _FORGET_SQL.encode())


_DJANGO_OPTIONS = {
    "pool",
    "isolation_level",
    "server_side_binding",
    "assume_role",
    "cursor_factory",
    "prepare_threshold",
}


class _Clients:
    """This event loop's Postgres pool and Redis client, made on first use."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.db: PgPool | None = None
        self.redis: Batches | None = None

    async def get(self) -> tuple[PgPool, Batches]:
        loop = asyncio.get_running_loop()
        if self.loop is not loop or self.db is None or self.redis is None:
            # A new loop (tests run one per test): the old clients belong to the old one.
            self.loop = loop
            db = connections["default"].settings_dict
            # libpq options (sslmode…) as Django passes them; not Django's own keys.
            db_options = db.get("OPTIONS") or {}
            options = {k: v for k, v in db_options.items() if k not in _DJANGO_OPTIONS}
            conninfo = psycopg.conninfo.make_conninfo(
                dbname=db["NAME"],
                user=db["USER"],
                password=db["PASSWORD"] or None,
                host=db["HOST"],
                port=str(db["PORT"]),
                **options,
            )
            # Named prepared statements, unless Django was told not to (PgBouncer).
            prepare = db_options.get("prepare_threshold", 5) is not None
            self.db = PgPool(conninfo, max_size=DB_POOL_MAX, prepare=prepare, timeout=10)
            self.redis = batches_for_url(settings.REDIS_URL)
        return self.db, self.redis


_clients = _Clients()


async def clients_close() -> None:
    """Closes this loop's pool and Redis client (tests; shutdown)."""
    if _clients.db is not None:
        await _clients.db.close()
    if _clients.redis is not None:
        await _clients.redis.close()
    _clients.loop = _clients.db = _clients.redis = None


_script_shas: dict[str, str] = {}


async def _admit(client: Batches, plan: ExecAdmitPlan, operation_pk: str) -> bool:
    """Runs the admission script and claims the liveness key in one round trip. True:
    admitted; False: refused (the regular path answers the 429); raises on Redis
    trouble. The key is fresh, so its claim cannot fail unless recovery raced us to
    it; like ``operation_exec`` we run anyway."""
    sha = _script_shas.get(plan.script)
    if sha is None:
        # The name Redis gives a script (SCRIPT LOAD's answer) is its SHA-1.
        digest = hashlib.sha1(plan.script.encode(), usedforsecurity=False)
        sha = _script_shas[plan.script] = digest.hexdigest()
    script_args = (len(plan.keys), *plan.keys, *plan.args)
    claim = ("SET", pump_key(operation_pk), pumps.owner, "NX", "EX", PUMP_TTL_S)
    reply = (await client.run(("EVALSHA", sha, *script_args), claim))[0]
    if isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT"):
        # Redis restarted or flushed its script cache: EVAL runs and caches it again.
        reply = (await client.run(("EVAL", plan.script, *script_args)))[0]
    if isinstance(reply, ReplyError):
        raise reply
    return int(reply[0]) == 0


async def _start(db: PgPool, params: list[Any]) -> tuple[Any, ...] | None:
    """(sandbox pk, generation, agent host, agent port, rows inserted), or None when no
    ready sandbox of this tenant has that id."""
    result = await db.execute(_START, params)
    if not result.ntuples:
        return None
    pk, generation, host, port, inserted = (result.get_value(0, i) for i in range(5))
    assert pk is not None and generation is not None and host is not None
    return (
        uuid.UUID(pk.decode()),
        int(generation),
        host.decode(),
        None if port is None else int(port),
        int(inserted or 0),
    )


async def _forget(db: PgPool, pk: uuid.UUID) -> None:
    """Removes a row that will not run (as ``exec_admit_operation`` does on a 429)."""
    try:
        await db.execute(_FORGET, [pk])
    except (psycopg.Error, OSError):
        await sync_to_async(_forget_orm)(pk)


async def _release(client: Batches, plan: ExecAdmitPlan) -> None:
    try:
        await client.run(*[("ZREM", key, plan.lease) for key in plan.release_keys])
    except (OSError, redis.RedisError):
        pass  # the lease expires at its deadline, as in exec_release


def request_record(request: ExecRequest) -> tuple[str, str]:
    """(the ``request`` column as JSON text, the fingerprint): ``operations.
    request_record``, the one definition, for a text parameter."""
    record, fingerprint = operation_request_record(request)
    return json.dumps(record), fingerprint


@dataclasses.dataclass(frozen=True)
class _Begun:
    """A ``running`` Operation row inserted and its exec admitted (lease taken)."""

    db: PgPool
    client: Batches
    plan: ExecAdmitPlan
    pk: uuid.UUID
    operation_id: str
    created_at: datetime
    sandbox_pk: uuid.UUID
    generation: int
    host: str
    port: int
    timeout: float
    key_id: str | None


async def _begin(
    *,
    principal: Principal,
    sandbox_external_id: str,
    request: ExecRequest,
    operation_id: str | None,
    expected_generation: int | None,
) -> _Begun | None:
    """Admission and the row, concurrently, in one round trip of waiting: the common
    start of every exec on the event loop. ``FALLBACK`` (None) with nothing changed
    when the regular path must answer (refused, missing, not ready, stale generation,
    a replay, Redis or Postgres trouble)."""
    tenant_id = str(principal.tenant.pk)
    limits = hot_limits_cached(tenant_id)
    if limits is None:
        try:
            limits = await single_flight(f"limits:{tenant_id}", hot_limits, tenant_id)
        except Exception:  # noqa: BLE001 - the regular path answers (and reports) it
            log.warning("exec fast path: limits lookup failed", exc_info=True)
            return FALLBACK
    key_id = str(principal.api_key.pk) if principal.api_key is not None else None
    timeout = _agent_timeout(request)
    plan = exec_admit_plan(
        limits=limits,
        tenant_id=tenant_id,
        api_key_id=key_id,
        timeout_s=timeout,
        sandbox_key=sandbox_external_id,
    )
    pk = uuid.uuid4()
    op_id = operation_id or f"op-{uuid.uuid4().hex}"
    created_at = timezone.now()
    try:
        db, client = await _clients.get()
    except (redis.RedisError, psycopg.Error, OSError):
        log.warning("exec fast path: Postgres unavailable", exc_info=True)
        return FALLBACK
    request_json, fingerprint = request_record(request)
    params = [
        principal.tenant.pk,
        sandbox_external_id,
        pk,
        op_id,
        request_json,
        fingerprint,
        principal.actor,
        created_at,
        expected_generation,
    ]
    # Admission and the row are independent: one round trip of waiting, not two. The
    # statement is sent inline, the admission in a task (one task, not gather's two).
    admitting = asyncio.ensure_future(_admit(client, plan, str(pk)))
    row: tuple[Any, ...] | BaseException | None
    admitted: bool | BaseException
    # Any failure before the agent call means: undo, log, let the regular path answer.
    try:
        row = await _start(db, params)
    except Exception as exc:  # noqa: BLE001
        row = exc
    try:
        admitted = await admitting
    except Exception as exc:  # noqa: BLE001
        admitted = exc
    inserted = isinstance(row, tuple) and bool(row[4])
    if admitted is not True or not inserted:
        # Refused, missing, not ready, stale generation, a replay, or trouble: nothing
        # ran; undo what was taken and let the regular path answer.
        for failure in (admitted, row):
            if isinstance(failure, BaseException):
                # Not raised here: the exception itself carries the traceback.
                log.warning("exec fast path: Redis or Postgres failed", exc_info=failure)
        if admitted is True:
            await _release(client, plan)
        if inserted:
            await _forget(db, pk)
        return FALLBACK
    assert isinstance(row, tuple)
    sandbox_pk, generation, host, port, _inserted = row
    return _Begun(
        db, client, plan, pk, op_id, created_at, sandbox_pk, generation, host, int(port),
        timeout, key_id,
    )  # fmt: skip


async def _undo(begun: _Begun) -> None:
    """Gives back what ``_begin`` took, for a start that will not run after all."""
    await _release(begun.client, begun.plan)
    await _forget(begun.db, begun.pk)


async def operation_exec_async(
    *,
    principal: Principal,
    sandbox_external_id: str,
    request: ExecRequest,
    operation_id: str | None,
    expected_generation: int | None,
    request_id: str,
) -> dict[str, Any] | None:
    """``operation_exec`` for the plain case, on the event loop. Returns the finished
    operation's fields for ``render_operation`` (the same record the regular path
    stores), or ``FALLBACK`` (None) with nothing changed: the caller must then run the
    regular path. Raises ``ApiError`` for an agent failure, exactly as that path does."""
    begun = await _begin(
        principal=principal,
        sandbox_external_id=sandbox_external_id,
        request=request,
        operation_id=operation_id,
        expected_generation=expected_generation,
    )
    if begun is None:
        return FALLBACK
    db, client, plan, pk = begun.db, begun.client, begun.plan, begun.pk
    op_id, timeout = begun.operation_id, begun.timeout
    pumps.track(str(pk))
    released = False
    try:
        try:
            result = await agent_exec(
                begun.host,
                begun.port,
                _token(begun.sandbox_pk.hex, begun.generation),
                request.agent_body(op_id),
                timeout=timeout,
                request_id=request_id,
            )
        except (AgentError, AgentUnreachable) as exc:
            await _release(client, plan)
            released = True
            await sync_to_async(_agent_failed)(pk, exc)
            raise AssertionError("operation_agent_failed always raises") from exc
        fields = result_fields(result)
        releasing = asyncio.ensure_future(_release(client, plan))
        updated = await _finish(db, pk, fields)
        await releasing
        released = True
    finally:
        # Whatever happened, the slot is given back and the liveness key left to expire
        # (a row still ``running`` after a bug is then recovered from the agent).
        pumps.release(str(pk), delete=False)
        if not released:
            await _release(client, plan)
    if not updated:
        # Finished by someone else meanwhile (recovery): answer what the row holds.
        return await sync_to_async(_stored_fields)(pk)
    fields.update(
        operation_id=op_id,
        sandbox_external_id=sandbox_external_id,
        generation=begun.generation,
        kind="exec",
        created_at=begun.created_at,
    )
    return fields


@dataclasses.dataclass(frozen=True)
class StreamStarted:
    """A streamed command started on this loop: its relay (``stream_pump``) runs as a
    task here and hands its frames to ``frames`` as it stores them (``stream_pump.
    listen``); the replay buffer has them too, for reconnects and other readers."""

    operation_pk: str
    operation_id: str
    sandbox_pk: uuid.UUID
    generation: int
    frames: asyncio.Queue[Any]


async def operation_exec_stream_async(
    *,
    principal: Principal,
    sandbox_external_id: str,
    request: ExecRequest,
    operation_id: str | None,
    sandbox_pk: uuid.UUID | None = None,
) -> StreamStarted | None:
    """``operation_exec_stream`` for the plain case, on the event loop: the same start
    as ``operation_exec_async`` (admission, the ``running`` row), then the relay task
    that ``operation_exec_stream`` would start, with this caller listening to it. The
    relay records the end as the regular path does, whether or not anyone listens.
    ``sandbox_pk``: the sandbox must be this one (a token that names it), else
    ``FALLBACK``. Returns ``FALLBACK`` (None) with nothing changed when the regular path
    must answer."""
    from apps.sandboxes.services import stream_pump  # imports this module's callers

    begun = await _begin(
        principal=principal,
        sandbox_external_id=sandbox_external_id,
        request=request,
        operation_id=operation_id,
        expected_generation=None,
    )
    if begun is None:
        return FALLBACK
    if sandbox_pk is not None and begun.sandbox_pk != sandbox_pk:
        await _undo(begun)
        return FALLBACK
    pk = str(begun.pk)
    pumps.track(pk)
    frames = stream_pump.listen(pk)
    job = _PumpJob(
        operation_pk=pk,
        agent=AgentClient(begun.host, begun.port, _token(begun.sandbox_pk.hex, begun.generation)),
        body=request.agent_body(begun.operation_id),
        timeout=begun.timeout,
        lease=ExecLease(
            tenant_id=str(principal.tenant.pk),
            api_key_id=begun.key_id,
            lease=begun.plan.lease,
            sandbox_key=sandbox_external_id,
        ),
        fresh=True,
        on_loop=True,
    )
    stream_pump.start_here(job)
    return StreamStarted(pk, begun.operation_id, begun.sandbox_pk, begun.generation, frames)


async def finish_fields(operation_pk: str, fields: dict[str, Any]) -> bool:
    """Records an agent's result on a ``running`` row (compare-and-set), as
    ``operation_record_result`` does, through this loop's Postgres pool."""
    db, _client = await _clients.get()
    return await _finish(db, uuid.UUID(operation_pk), fields)


# How each of ``_FINISH_SQL``'s parameters is sent: JSON columns as JSON text, text as
# ``str`` (a choices enum as its value), the rest as they are. Looked up once.
_AS_TEXT: Final[dict[str, Callable[[Any], str]]] = {"JSONField": json.dumps, "CharField": str}
_FINISH_ENCODERS: Final = [
    (field.name, _AS_TEXT.get(field.get_internal_type())) for field in _RESULT_FIELDS
]


def _finish_params(pk: uuid.UUID, fields: dict[str, Any]) -> list[Any]:
    """``_FINISH_SQL``'s parameters, in ``RESULT_COLUMNS`` order after the row's id."""
    params: list[Any] = [pk]
    for name, encode in _FINISH_ENCODERS:
        value = fields[name]
        params.append(value if encode is None or value is None else encode(value))
    return params


async def _finish(db: PgPool, pk: uuid.UUID, fields: dict[str, Any]) -> bool:
    params = _finish_params(pk, fields)
    try:
        result = await db.execute(_FINISH, params)
        return bool(result.command_tuples)
    except (psycopg.Error, OSError):
        # The command ran: its result must be stored, through the regular path's pool.
        log.warning("exec fast path: result update failed; retrying via the ORM", exc_info=True)
        return await sync_to_async(_finish_orm)(pk, fields)


P = ParamSpec("P")
R = TypeVar("R")

_flights: dict[str, asyncio.Future[Any]] = {}


async def single_flight(key: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args)`` in a thread (it uses the ORM), one at a time per ``key`` in this
    process; callers arriving meanwhile wait for the same result. For the caches the
    fast path reads (key → principal, limits; 5 s each): when an entry goes stale, one
    exec refreshes it and the concurrent ones wait for that, instead of every exec in
    flight taking the regular path at once, every 5 s, in every process."""
    pending = _flights.get(key)
    if pending is None or pending.get_loop() is not asyncio.get_running_loop():
        call = sync_to_async(_in_thread(fn), thread_sensitive=False)(*args, **kwargs)
        flight: asyncio.Future[Any] = asyncio.ensure_future(call)
        _flights[key] = pending = flight

        def landed(done: asyncio.Future[Any]) -> None:
            if _flights.get(key) is done:
                del _flights[key]

        flight.add_done_callback(landed)
    result: R = await asyncio.shield(pending)  # one waiter cancelled: the others still wait
    return result


def _in_thread(fn: Callable[P, R]) -> Callable[P, R]:
    """For ``sync_to_async`` on the rare paths: the ORM outside a Django request gets no
    request_finished signal, so the thread's connection is closed (back to the pool)
    here rather than kept by a thread nobody cleans up."""

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            connections["default"].close()

    return run


@_in_thread
def _finish_orm(pk: uuid.UUID, fields: dict[str, Any]) -> bool:
    return operation_finish(pk, fields)


@_in_thread
def _forget_orm(pk: uuid.UUID) -> None:
    Operation.objects.filter(pk=pk, status=OperationStatus.RUNNING).delete()


@_in_thread
def _agent_failed(pk: uuid.UUID, exc: AgentError | AgentUnreachable) -> None:
    operation = Operation.objects.select_related("sandbox").get(pk=pk)
    operation_agent_failed(sandbox=operation.sandbox, operation=operation, exc=exc)


@_in_thread
def _stored_fields(pk: uuid.UUID) -> dict[str, Any]:
    operation = Operation.objects.select_related("sandbox").get(pk=pk)
    return operation_fields(operation)


def operation_fields(operation: Operation) -> dict[str, Any]:
    """An Operation row as the fields ``render_operation`` takes."""
    return {
        "operation_id": operation.operation_id,
        "sandbox_external_id": operation.sandbox.external_id,
        "generation": operation.generation,
        "kind": operation.kind,
        "status": operation.status,
        "termination": operation.termination,
        "exit_code": operation.exit_code,
        "signal": operation.signal,
        "stdout": operation.stdout,
        "stderr": operation.stderr,
        "usage": operation.usage,
        "children_remained": operation.children_remained,
        "error": operation.error,
        "created_at": operation.created_at,
        "finished_at": operation.finished_at,
    }


_tokens: dict[tuple[str, int], str] = {}


def _token(sandbox_hex: str, generation: int) -> str:
    """Agent tokens are an HMAC per (sandbox, generation): computed once per process."""
    token = _tokens.get((sandbox_hex, generation))
    if token is None:
        if len(_tokens) > 4096:
            _tokens.clear()
        token = _tokens[(sandbox_hex, generation)] = agent_token(sandbox_hex, generation)
    return token


def iso(value: datetime | None) -> str | None:
    """A datetime as DRF renders it (UTC, ``Z``)."""
    if value is None:
        return None
    # As timezone.localtime: nothing activates another zone on this loop (no Django
    # middleware runs here), and its asgiref.Local lookup was a measurable cost.
    text = value.astimezone(timezone.get_default_timezone()).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text
