"""Every sandbox state change. Transitions are compare-and-set and write the ledger.

This module is the one writer of ``Sandbox.state`` (issue 18): a create's first state
(``sandbox_insert``, or ``sandbox_insert_claimed`` for a warm-pool claim, born
``ready``), every later move (``sandbox_transition``), each with its ledger rows and
its usage-ledger write in the same statement, then the same after-step
(``_after_move``: the metering repair and the state event). No other product module
writes the column or a ledger row; ``apps/sandboxes/tests/test_transition_writer.py``
scans for one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import secrets
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, cast

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.sql import InsertQuery, UpdateQuery
from django.utils import timezone

from apps.billing.quotas import Ask
from apps.core.egress import EgressError, EgressPolicy, parse_egress
from apps.core.errors import Conflict, ValidationFailed
from apps.sandboxes.admission import admission_check
from apps.sandboxes.events import publish_sandbox_state
from apps.sandboxes.image_catalog import image_catalog
from apps.sandboxes.metering.usage import (
    UsageWrite,
    open_record_sql,
    usage_after_transition,
    usage_write_for_transition,
)
from apps.sandboxes.models import LIVE_STATES, Sandbox, SandboxEvent, State
from apps.sandboxes.selectors import sandbox_by_idempotency_key
from apps.tenancy.activity import activity_record
from apps.tenancy.models import Action, Tenant

log = logging.getLogger(__name__)

EXTERNAL_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# Words that read as commands or collections in URLs and UIs; refused as ids.
RESERVED_IDS = frozenset({"all", "new", "list", "create", "health", "resources", "jobs", "me"})
_CAS_ATTEMPTS = 5
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$")


@dataclass(frozen=True)
class SandboxRequest:
    image: str
    cpu_millis: int
    memory_mib: int
    network_access: bool = False  # routed at all: egress "all" or an allowlist
    ttl_seconds: int = 3600
    heartbeat_timeout_s: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    external_id: str | None = None
    # Over a limit: wait in the admission queue (True) or get a 429; None: team default.
    queue: bool | None = None
    # restore this snapshot (the tenant's, ``ready``): ``image`` must be its image
    snapshot_id: str | None = None
    # The egress policy in canonical form (``egress_policy``): "none", "all" or
    # {"allow": [...], "dns": "filtered"}; None: from ``network_access`` (callers that
    # only know that flag, e.g. the Orchard and E2B layers, keep their meaning).
    egress: Any = None

    def __post_init__(self) -> None:
        if self.egress is None:
            object.__setattr__(self, "egress", "all" if self.network_access else "none")
        # network_access is derived: routed at all
        object.__setattr__(self, "network_access", self.egress != "none")

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def validate_external_id(value: str) -> str:
    if not EXTERNAL_ID_RE.match(value):
        raise ValidationFailed(
            "sandbox ids are 1-63 lowercase letters, digits or '-', starting and ending "
            "with a letter or digit",
            field="sandbox_id",
            code="invalid_sandbox_id",
        )
    if value in RESERVED_IDS:
        raise ValidationFailed(
            f"{value!r} is a reserved word", field="sandbox_id", code="invalid_sandbox_id"
        )
    return value


def egress_policy(value: Any, network_access: bool | None = None) -> EgressPolicy:
    """The policy a request asks for: ``egress`` if given, else ``network_access``
    (true is "all"), else "none". Both given and disagreeing is a 400, never a guess."""
    if value is None:
        return parse_egress("all" if network_access else "none")
    try:
        policy = parse_egress(value)
    except EgressError as exc:
        raise ValidationFailed(exc.message, field="egress", extra={"reason": exc.code}) from None
    if network_access is not None and network_access != (policy.mode == "all"):
        raise ValidationFailed(
            f"network_access={str(network_access).lower()} contradicts egress "
            f"{policy.to_json()!r}: give egress alone",
            field="egress",
            extra={"reason": "egress_conflict"},
        )
    return policy


def validate_labels(labels: dict[str, Any]) -> dict[str, str]:
    if len(labels) > 32:
        raise ValidationFailed("at most 32 labels", field="labels")
    clean: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not LABEL_KEY_RE.match(key):
            raise ValidationFailed(f"invalid label key {key!r}", field="labels")
        if not isinstance(value, str) or len(value) > 253:
            raise ValidationFailed(f"label {key!r} must be a string ≤ 253 chars", field="labels")
        clean[key] = value
    return clean


def _event(
    sandbox: Sandbox,
    *,
    event: str,
    from_state: str = "",
    to_state: str = "",
    reason: str = "",
    message: str = "",
    actor: str = "system",
) -> SandboxEvent:
    return SandboxEvent.objects.create(
        sandbox=sandbox,
        tenant_id=sandbox.tenant_id,
        event=event,
        from_state=from_state,
        to_state=to_state,
        reason=reason,
        message=message[:2000],
        actor=actor,
        generation=sandbox.generation,
    )


def sandbox_record_event(
    *, sandbox: Sandbox, event: str, reason: str = "", message: str = "", actor: str = "system"
) -> SandboxEvent:
    """Appends a non-transition fact (a retry, a heartbeat expiry warning) to the ledger."""
    return _event(sandbox, event=event, reason=reason, message=message, actor=actor)


def sandbox_transition(
    *,
    sandbox: Sandbox,
    from_states: tuple[str, ...],
    to_state: str,
    reason: str,
    actor: str = "system",
    message: str = "",
    bump_generation: bool = False,
    **fields: Any,
) -> bool:
    """Compare-and-set: moves the row only if it is still in one of ``from_states``.

    Returns True if this caller made the transition (exactly one row changed), in
    which case the ledger has the event, the usage ledger its metering, and listeners
    are told after commit. On False nothing was written and ``sandbox`` is refreshed
    from the database.

    The move, its ledger row and its metering are one statement (``_compare_and_set``):
    atomic on its own, so it needs no transaction of its own, and when the caller has
    one it commits with it.
    """
    # Another transition may commit between our read and our update (a delete racing
    # requested → provisioning). If the row is then still in one of our from_states,
    # the move is still ours to make: read again and retry, instead of silently
    # dropping it (a lost delete left sandboxes running).
    # First try from the caller's own view of the row (a task that has just loaded it,
    # a view that has just fetched it): when the row is still as the caller saw it,
    # the compare-and-set is the statement alone. Otherwise (a stale instance, a lost
    # race) read and retry.
    if "state" in fields or "generation" in fields:
        raise TypeError("sandbox_transition: the state and generation are its own to set")
    seen: tuple[str, int] | None = None
    if sandbox.state in from_states and sandbox.generation is not None:
        seen = (sandbox.state, sandbox.generation)
    for _attempt in range(_CAS_ATTEMPTS + (seen is not None)):
        current: tuple[str, int] | None
        if seen is not None:
            current, seen = seen, None
        else:
            current = (
                Sandbox.objects.filter(pk=sandbox.pk, state__in=from_states)
                .values_list("state", "generation")
                .first()
            )
        if current is None:
            sandbox.refresh_from_db()
            return False
        from_state, generation = current
        updates: dict[str, Any] = {
            "state": to_state,
            "generation": generation + 1 if bump_generation else generation,
            "updated_at": timezone.now(),
            **fields,
        }
        if message or to_state in (State.FAILED, State.LOST):
            updates["status_message"] = message
        moved = _compare_and_set(
            sandbox,
            from_state=from_state,
            generation=generation,
            updates=updates,
            reason=reason,
            message=message,
            actor=actor,
        )
        if moved is not None:
            break
    else:
        sandbox.refresh_from_db()
        return False
    _after_move(
        sandbox, to_state=to_state, written=moved.usage_written, queue_waiting=moved.queue_waiting
    )
    log.info(
        "sandbox %s: %s -> %s (%s)",
        sandbox.external_id,
        from_state,
        to_state,
        reason,
        extra={"sandbox_id": str(sandbox.id), "event": "transition"},
    )
    return True


def _after_move(
    sandbox: Sandbox, *, to_state: str, written: int | None, queue_waiting: bool
) -> None:
    """What follows every write of the state, once its statement ran: the usage
    ledger's repair when the statement could not write it (``written == 0``), the
    admission queue's drain when capacity was freed, and the state event for waiters
    (after commit)."""
    usage_after_transition(
        sandbox=sandbox, to_state=to_state, written=written, queue_waiting=queue_waiting
    )
    publish_sandbox_state(sandbox)


@dataclass(frozen=True)
class _Moved:
    event_id: int
    usage_written: int | None  # usage records written; None: the move meters nothing
    queue_waiting: bool


LEDGER_COLUMNS = (
    "sandbox_id",
    "tenant_id",
    "at",
    "event",
    "from_state",
    "to_state",
    "reason",
    "message",
    "actor",
    "generation",
)
# What the usage ledger's part of the statement reads from the moved row (the warm
# pool's claim statement reads the same from the row it inserts).
MOVED_ROW_COLUMNS = (
    "id",
    "tenant_id",
    "image",
    "backend",
    "node",
    "labels",
    "cpu_millis",
    "memory_mib",
)


def _compare_and_set(
    sandbox: Sandbox,
    *,
    from_state: str,
    generation: int,
    updates: dict[str, Any],
    reason: str,
    message: str,
    actor: str,
) -> _Moved | None:
    """One statement: the UPDATE of the row if it is still in ``from_state`` at
    ``generation``, and — only if it matched — the ledger INSERT and the usage ledger's
    write (``usage_write_for_transition``). None when the row had moved on (nothing
    written). On success ``updates`` are applied to ``sandbox``: the row now holds
    exactly them, so it is not read back.

    Three statements and a savepoint inside a transaction before (UPDATE, INSERT, the
    usage hook through ``post_save``), each a round trip and a parse; with Postgres's
    data-modifying CTEs all three see the same snapshot and commit together.
    """
    at = timezone.now()
    to_state = updates["state"]
    # Metering reads what the row holds after the move (the node a move to ready sets).
    after = copy.copy(sandbox)
    for name, value in updates.items():
        setattr(after, name, value)
    usage = usage_write_for_transition(
        sandbox=after, from_state=from_state, to_state=to_state, reason=reason, at=at
    )
    query = Sandbox.objects.filter(pk=sandbox.pk, state=from_state, generation=generation).query
    update = cast(UpdateQuery, query.chain(UpdateQuery))
    update.add_update_values(updates)
    update_sql, update_params = update.get_compiler(connection.alias).as_sql()
    table = connection.ops.quote_name(Sandbox._meta.db_table)
    events = connection.ops.quote_name(SandboxEvent._meta.db_table)
    returning = ", ".join(f"{table}.{connection.ops.quote_name(c)}" for c in MOVED_ROW_COLUMNS)
    columns = ", ".join(connection.ops.quote_name(c) for c in LEDGER_COLUMNS)
    sql = [
        # Names from the models, values as parameters: not an injection.
        f"WITH moved AS ({update_sql} RETURNING {returning}), "  # noqa: S608
        f"logged AS (INSERT INTO {events} ({columns}) "
        "SELECT m.id, m.tenant_id, %s, 'transition', %s, %s, %s, %s, %s, %s FROM moved AS m "
        "RETURNING id)"
    ]
    params: list[Any] = [
        *update_params,
        at,
        from_state,
        to_state,
        reason,
        message[:2000],
        actor,
        updates["generation"],
    ]
    if usage is not None and usage.sql is not None:
        sql.append(f", metered AS ({usage.sql})")
        params.extend(usage.params)
        sql.append(" SELECT logged.id, (SELECT count(*) FROM metered)")
    else:
        sql.append(" SELECT logged.id, NULL")
    sql.append(
        f", {UsageWrite.DRAIN_SQL}" if usage is not None and usage.drain_check else ", false"
    )
    sql.append(" FROM logged")
    with connection.cursor() as cursor:
        cursor.execute("".join(sql), params)
        row = cursor.fetchone()
    if row is None:
        return None
    for name, value in updates.items():
        setattr(sandbox, name, value)
    return _Moved(event_id=row[0], usage_written=row[1], queue_waiting=bool(row[2]))


def sandbox_insert(*, sandbox: Sandbox, state: str, actor: str) -> None:
    """Inserts a new ``sandbox`` (not saved yet) in its first state (``requested`` or
    ``queued``) with its ``created`` ledger row, inside the caller's transaction: one
    statement (a data-modifying CTE), as ``sandbox_insert_claimed``. Its first state
    meters nothing (a record opens at ``provisioning``), so the ledger's ``post_save``
    usage hook, which the ORM way ran, has nothing to do for it.

    Why one statement: a create runs it holding the tenant's quota row, so a burst of
    one tenant's creates is answered one round trip faster each (docs/benchmarks.md,
    "The cold burst on make up's configuration")."""
    sandbox.state = state
    insert = InsertQuery(Sandbox)
    insert.insert_values([f for f in Sandbox._meta.concrete_fields if not f.generated], [sandbox])
    ((insert_sql, insert_params),) = insert.get_compiler(connection.alias).as_sql()
    quote = connection.ops.quote_name
    table = quote(Sandbox._meta.db_table)
    events = quote(SandboxEvent._meta.db_table)
    columns = ", ".join(quote(c) for c in LEDGER_COLUMNS)
    # Names from the models, values as parameters: not an injection.
    sql = (
        f"WITH made AS ({insert_sql} RETURNING {table}.{quote('id')}, "  # noqa: S608
        f"{table}.{quote('tenant_id')}) "
        f"INSERT INTO {events} ({columns}) "
        "SELECT made.id, made.tenant_id, %s::timestamptz, 'created', '', %s, 'api', '', %s, %s "
        "FROM made"
    )
    params = [*insert_params, timezone.now(), state, actor, sandbox.generation]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        written = cursor.rowcount
    if written != 1:
        # Inside the create's transaction: it rolls back, never a row without its ledger.
        raise DatabaseError(f"sandbox insert wrote {written} ledger rows, expected 1")
    sandbox._state.adding = False
    sandbox._state.db = connection.alias
    publish_sandbox_state(sandbox)


def sandbox_insert_claimed(*, sandbox: Sandbox, reason: str, message: str, actor: str) -> None:
    """Inserts the ``sandbox`` of a warm-pool claim (not saved yet) in ``ready`` with its
    ledger — ``created`` (requested, as every create) then requested → ready with
    ``reason`` — and opens its usage record at that event: one statement.

    The same rows the ORM way writes (``Sandbox.objects.create``, two
    ``SandboxEvent.objects.create`` and the ``post_save`` usage hook, a savepoint and
    five or more statements): Postgres's data-modifying CTEs see one snapshot and
    commit together. A usage record the statement could not open (no price book) is
    opened the ORM's way (``_after_move``), as a transition's is.
    """
    sandbox.state = State.READY
    created_at = sandbox.created_at or timezone.now()
    ready_at = timezone.now()
    insert = InsertQuery(Sandbox)
    insert.insert_values([f for f in Sandbox._meta.concrete_fields if not f.generated], [sandbox])
    ((insert_sql, insert_params),) = insert.get_compiler(connection.alias).as_sql()
    usage_sql, usage_params = open_record_sql(sandbox=sandbox, at=ready_at)
    quote = connection.ops.quote_name
    table = quote(Sandbox._meta.db_table)
    returning = ", ".join(f"{table}.{quote(c)}" for c in MOVED_ROW_COLUMNS)
    events = quote(SandboxEvent._meta.db_table)
    columns = ", ".join(quote(c) for c in LEDGER_COLUMNS)
    # Names from the models, values as parameters: not an injection. The ledger rows
    # are inserted in ``ord`` order, so their ids are in ledger order as before.
    sql = (
        f"WITH moved AS ({insert_sql} RETURNING {returning}), "  # noqa: S608
        f"logged AS (INSERT INTO {events} ({columns}) "
        "SELECT m.id, m.tenant_id, v.at, v.event, v.from_state, v.to_state, v.reason, "
        "v.message, %s, %s FROM moved AS m CROSS JOIN (VALUES "
        "(1, %s::timestamptz, 'created', '', %s, 'api', ''), "
        "(2, %s::timestamptz, 'transition', %s, %s, %s, %s)) "
        "AS v(ord, at, event, from_state, to_state, reason, message) "
        "ORDER BY v.ord RETURNING 1), "
        f"metered AS ({usage_sql}) "
        "SELECT (SELECT count(*) FROM logged), (SELECT count(*) FROM metered)"
    )
    params = [
        *insert_params,
        actor,
        sandbox.generation,
        created_at,
        State.REQUESTED.value,
        ready_at,
        State.REQUESTED.value,
        State.READY.value,
        reason,
        message,
        *usage_params,
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None or row[0] != 2:
        # Raised inside the create's transaction: it rolls back, the member goes back
        # to the pool and the client gets a 500, never a sandbox with half a ledger.
        raise DatabaseError(f"warm pool claim wrote {row!r} ledger rows, expected 2")
    sandbox._state.adding = False
    sandbox._state.db = connection.alias
    _after_move(sandbox, to_state=State.READY, written=row[1], queue_waiting=False)


def _new_external_id() -> str:
    return f"sb-{secrets.token_hex(6)}"


def sandbox_create(
    *,
    tenant: Tenant,
    request: SandboxRequest,
    idempotency_key: str | None,
    actor: str,
    backend_name: str | None = None,
) -> tuple[Sandbox, bool]:
    """Records a sandbox in ``requested`` and enqueues provisioning after commit, or in
    ``queued`` when admission says it must wait (provisioned later by the queue). An
    admitted create whose shape matches a warm pool member claims it instead and is
    ``ready`` at once (``services/warm_pool.py``).

    Idempotent by ``idempotency_key``: the same key and body return the existing
    sandbox (created=False); the same key with a different body is a 409. A taken
    ``external_id`` is a 409. A host short of disk is a 507 ``disk_exhausted``
    (``services/disk_guard.py``). Never leaves a half-created row: the row, its ledger
    event and the enqueue happen together or not at all.
    """
    from apps.sandboxes.services.disk_guard import disk_guard
    from apps.sandboxes.services.warm_pool import warm_pool_claim, warm_pool_record_claim
    from apps.sandboxes.tasks import provision_sandbox

    if idempotency_key is not None:
        existing = sandbox_by_idempotency_key(tenant=tenant, idempotency_key=idempotency_key)
        if existing is not None:
            return _replayed(existing, request), False
    from apps.sandboxes.services.egress import egress_quota_check, egress_supported_check

    requested_egress = parse_egress(request.egress)
    egress_supported_check(
        policy=requested_egress, backend_name=backend_name or settings.HEDGEROW_BACKEND
    )
    egress_quota_check(tenant=tenant, policy=requested_egress)
    disk_guard()  # 507 disk_exhausted before anything is recorded
    sent = request  # a replay compares the request as sent
    fingerprint = sent.fingerprint()
    snapshot = None
    if request.snapshot_id is not None:
        from apps.sandboxes.services.snapshots import snapshot_for_restore

        # the tenant's own ready snapshot, or a 404/409; its image is exact (by digest)
        # and held by the snapshot, so no registry is asked
        snapshot = snapshot_for_restore(tenant=tenant, snapshot_id=request.snapshot_id)
        if request.image and request.image != snapshot.image:
            raise ValidationFailed(
                f"the snapshot is of image {snapshot.image!r}",
                field="image",
                code="snapshot_image_mismatch",
            )
        request = replace(request, image=snapshot.image)  # "": the snapshot's
        digest = snapshot.image_digest
    else:
        # The image can be had by this tenant (its registry credentials, the registry's
        # answer now), or a typed 4xx before anything is recorded: never a sandbox that
        # fails later for an image it could never get, never another image instead.
        digest = image_catalog().resolve_digest(tenant, request.image)
    external_id = request.external_id or _new_external_id()
    now = timezone.now()
    try:
        with transaction.atomic():
            admitted = admission_check(tenant=tenant, request=request, actor=actor)
            # A queued create claims nothing: it holds no resources until admitted.
            # Warm members are "none" or "all" (their netns is made): an allowlist
            # sandbox is always provisioned for itself.
            warm = (
                None
                if snapshot is not None  # a restore starts from its own state
                else warm_pool_claim(
                    image=request.image,
                    cpu_millis=request.cpu_millis,
                    memory_mib=request.memory_mib,
                    network_access=request.network_access,
                    backend_name=backend_name,
                )
                if admitted and request.egress in ("none", "all")
                else None
            )
            # Its state is the writer's to set (``sandbox_insert``, the claim's insert).
            sandbox = Sandbox(
                **(warm.sandbox_fields(now) if warm else {}),
                admitted_at=now if admitted else None,
                tenant=tenant,
                external_id=external_id,
                image=request.image,
                image_digest=digest,
                snapshot=snapshot,
                cpu_millis=request.cpu_millis,
                memory_mib=request.memory_mib,
                network_access=request.network_access,
                egress=request.egress,
                labels=request.labels,
                ttl_seconds=request.ttl_seconds,
                expires_at=now + timedelta(seconds=request.ttl_seconds),
                heartbeat_timeout_s=request.heartbeat_timeout_s,
                last_heartbeat_at=now,
                idempotency_key=idempotency_key,
                request_hash=fingerprint,
                backend=backend_name or settings.HEDGEROW_BACKEND,
                created_by=actor,
                created_at=now,
            )
            image_catalog().mark_used(tenant, [digest])
            if warm is not None:
                # The row, its two ledger rows and its usage record: one statement.
                warm_pool_record_claim(sandbox=sandbox, claimed=warm, actor=actor)
                return sandbox, True
            sandbox_insert(
                sandbox=sandbox, state=State.REQUESTED if admitted else State.QUEUED, actor=actor
            )
            sandbox_id = str(sandbox.id)
            if admitted:  # a queued sandbox is provisioned when the queue admits it
                transaction.on_commit(lambda: provision_sandbox.delay(sandbox_id))
    except IntegrityError:
        # A concurrent create with the same key or id won the race.
        if idempotency_key is not None:
            existing = Sandbox.objects.filter(
                tenant=tenant, idempotency_key=idempotency_key
            ).first()
            if existing is not None:
                return _replayed(existing, sent), False
        raise Conflict(
            f"a sandbox with id {external_id!r} already exists",
            field="sandbox_id",
            code="sandbox_exists",
        ) from None
    return sandbox, True


def sandbox_create_fork(
    *,
    tenant: Tenant,
    request: SandboxRequest,
    snapshot: Any,
    count: int,
    idempotency_keys: list[str] | None,
    actor: str,
    backend_name: str,
) -> list[Sandbox]:
    """``count`` sandboxes restored from ``snapshot`` (a ready ``Snapshot`` of this
    tenant), all of ``request``'s shape: what ``count`` calls of ``sandbox_create``
    would record, decided and written as one — one admission under one quota lock for
    the ``count`` together (refused whole with the limit it breaks, never queued),
    one multi-row insert of the rows and one of their ``created`` ledger rows — and
    their provisioning enqueued after commit (``provision_sandboxes``). All or none:
    a failure anywhere rolls every row back. An ``IntegrityError`` (a concurrent fork
    with the same keys won) propagates for the caller's replay."""
    from apps.sandboxes.admission import admission_decide
    from apps.sandboxes.services.disk_guard import disk_guard
    from apps.sandboxes.services.egress import egress_quota_check

    if isinstance(request.egress, dict) and backend_name != "local":
        raise ValidationFailed(
            "egress allowlists need the local backend (docs/egress.md)",
            field="egress",
            extra={"reason": "egress_unsupported"},
        )
    egress_quota_check(tenant=tenant, policy=parse_egress(request.egress))
    disk_guard()
    fingerprint = request.fingerprint()
    now = timezone.now()
    with transaction.atomic():
        ask = Ask(
            cpu_millis=request.cpu_millis,
            memory_mib=request.memory_mib,
            ttl_seconds=request.ttl_seconds,
            actor=actor,
        )
        admission_decide(tenant=tenant, ask=ask, queue=False, count=count)
        rows = [
            Sandbox(
                state=State.REQUESTED,
                admitted_at=now,
                tenant=tenant,
                external_id=_new_external_id(),
                image=snapshot.image,
                image_digest=snapshot.image_digest,
                snapshot=snapshot,
                cpu_millis=request.cpu_millis,
                memory_mib=request.memory_mib,
                network_access=request.network_access,
                egress=copy.deepcopy(request.egress),
                labels=dict(request.labels),
                ttl_seconds=request.ttl_seconds,
                expires_at=now + timedelta(seconds=request.ttl_seconds),
                heartbeat_timeout_s=request.heartbeat_timeout_s,
                last_heartbeat_at=now,
                idempotency_key=idempotency_keys[i] if idempotency_keys else None,
                request_hash=fingerprint,
                backend=backend_name,
                created_by=actor,
                created_at=now,
            )
            for i in range(count)
        ]
        Sandbox.objects.bulk_create(rows)
        # ``created`` rows meter nothing (the usage hook follows transitions only), so
        # the ledger's post_save hook that bulk_create skips has nothing to do here
        SandboxEvent.objects.bulk_create(
            [
                SandboxEvent(
                    sandbox=row,
                    tenant_id=row.tenant_id,
                    at=now,
                    event="created",
                    to_state=row.state,
                    reason="api",
                    actor=actor,
                    generation=row.generation,
                )
                for row in rows
            ]
        )
        image_catalog().mark_used(tenant, [snapshot.image_digest])
        for row in rows:
            publish_sandbox_state(row)
        ids = [str(row.id) for row in rows]
        transaction.on_commit(lambda: _enqueue_fork(ids))
    return rows


def _enqueue_fork(ids: list[str]) -> None:
    """The children in ``HEDGEROW_FORK_TASKS`` shares, one task each (not K tasks)."""
    from apps.sandboxes.tasks import provision_sandboxes

    shares = max(1, min(settings.HEDGEROW_FORK_TASKS, len(ids)))
    for i in range(shares):
        provision_sandboxes.delay(ids[i::shares])


def _replayed(existing: Sandbox, request: SandboxRequest) -> Sandbox:
    if request.fingerprint() != existing.request_hash:
        raise Conflict(
            "this idempotency key was used for a different sandbox request",
            field="idempotency_key",
            code="idempotency_mismatch",
        )
    return existing


def sandbox_delete(*, sandbox: Sandbox, actor: str, reason: str = "deleted") -> Sandbox:
    """Starts deletion. Idempotent: deleting a terminating or deleted sandbox is a no-op.

    ``requested``/``provisioning``/``ready`` → ``terminating`` and a destroy task is
    enqueued after commit. ``failed``/``lost`` sandboxes also get a destroy so any
    residue is removed, but keep their final state.
    """
    from apps.sandboxes.tasks import destroy_sandbox

    sandbox_id = str(sandbox.id)
    with transaction.atomic():
        moved = sandbox_transition(
            sandbox=sandbox,
            from_states=(
                State.QUEUED,
                State.REQUESTED,
                State.PROVISIONING,
                State.READY,
                State.PAUSED,
            ),
            to_state=State.TERMINATING,
            reason=reason,
            actor=actor,
        )
        if moved:  # the team's activity log: who deleted it (a repeat is not logged)
            activity_record(
                tenant=str(sandbox.tenant_id),
                actor=actor,
                action=Action.SANDBOX_DELETED,
                target_type="sandbox",
                target_id=sandbox.external_id or sandbox_id,
                target_name=sandbox.external_id or sandbox_id,
                details={"reason": reason, "image": sandbox.image},
            )
    if moved or sandbox.state in (State.FAILED, State.LOST):
        transaction.on_commit(lambda: destroy_sandbox.delay(sandbox_id))
    return sandbox


def sandbox_heartbeat(*, sandbox: Sandbox) -> Sandbox:
    """Records liveness from the client; only live sandboxes accept heartbeats."""
    if sandbox.state not in (*LIVE_STATES, State.QUEUED) or sandbox.state == State.TERMINATING:
        raise Conflict(f"sandbox is {sandbox.state}", code=f"sandbox_{sandbox.state}", field=None)
    now = timezone.now()
    fields: dict[str, Any] = {"last_heartbeat_at": now}
    if sandbox.heartbeat_timeout_s:
        # Moves the reaper's due time (an indexed column) only when it is within half a
        # timeout of now: most heartbeats then write no index entry (a HOT update), and
        # the due time stays no later than the real deadline (models.Sandbox).
        timeout = timedelta(seconds=sandbox.heartbeat_timeout_s)
        fields["heartbeat_due_at"] = Case(
            When(
                Q(heartbeat_due_at__isnull=True) | Q(heartbeat_due_at__lt=now + timeout / 2),
                then=Value(now + timeout),
            ),
            default=F("heartbeat_due_at"),
        )
    Sandbox.objects.filter(pk=sandbox.pk).update(**fields)
    sandbox.last_heartbeat_at = now
    return sandbox


def sandbox_set_expiry(*, sandbox: Sandbox, seconds: int) -> Sandbox:
    """Moves a live sandbox's ``expires_at`` to ``seconds`` from now (shorter or
    longer; the TTL reaper ends it then). At most HEDGEROW_MAX_TTL_S; a sandbox that is
    terminating or final is a 409. Compare-and-set on the state, so a sandbox that
    started terminating meanwhile is never given a new lifetime."""
    if seconds < 0 or seconds > settings.HEDGEROW_MAX_TTL_S:
        raise ValidationFailed(
            f"timeout must be 0 to {settings.HEDGEROW_MAX_TTL_S} seconds", field="timeout"
        )
    expires_at = timezone.now() + timedelta(seconds=seconds)
    moved = Sandbox.objects.filter(
        pk=sandbox.pk, state__in=(State.QUEUED, State.REQUESTED, State.PROVISIONING, State.READY)
    ).update(expires_at=expires_at)
    if not moved:
        sandbox.refresh_from_db(fields=["state"])
        raise Conflict(f"sandbox is {sandbox.state}", code=f"sandbox_{sandbox.state}")
    sandbox.expires_at = expires_at
    return sandbox
