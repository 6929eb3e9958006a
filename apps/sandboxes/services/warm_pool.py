"""The warm pool: started sandboxes of configured shapes, claimed by matching creates.

* **Members** (``WarmMember`` rows) are provisioned ahead of demand under UUIDs the
  pool chooses, with no tenant. The backend names every resource after that UUID.
* **Claim** (``warm_pool_claim``, inside the create transaction, after admission):
  one ``DELETE … RETURNING`` of the oldest warm member of the same shape, skipping
  rows another create holds — two creates can never get the same member. The caller
  writes the ``Sandbox`` row with the member's id and generation, so the agent token
  (an HMAC of both) is the one the running agent already holds. If the transaction
  rolls back the row comes back: nothing is lost.
* **Dead members** are never handed out: the backend's own view (is the sandbox's
  process alive, at the endpoint recorded?) is checked at claim; a dead one is dropped
  and its resources destroyed after commit, and the claim tries the next member.
* **Refill** (``warm_pool_refill``): at most ``HEDGEROW_WARM_POOL_MAX_WARMING``
  members start at once; a shape whose member failed to start waits
  ``HEDGEROW_WARM_POOL_BACKOFF_S``. *When* (``warm_pool_refill_when_due``, the task beat
  and claims enqueue): once claims and misses have been quiet for
  ``HEDGEROW_WARM_POOL_REFILL_QUIET_S`` — a member started during a burst costs what
  the cold path costs, competes with the burst, and is only needed after it — or once
  a refill has been held back ``HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S`` (a steady
  stream of claims is never quiet). Each member that comes up asks for the next.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.db.models import Count
from django.utils import timezone

from apps.core.redis_sync import redis_client
from apps.sandboxes.agent_client import agent_token
from apps.sandboxes.backends import address_capacity, get_backend
from apps.sandboxes.backends.base import BackendError, SandboxSpec
from apps.sandboxes.models import LIVE_STATES, Sandbox, State, WarmMember, WarmMemberState
from apps.sandboxes.quantities import QuantityError, parse_cpu_millis, parse_memory_mib
from apps.sandboxes.services.lifecycle import sandbox_insert_claimed

log = logging.getLogger(__name__)

CLAIM_REASON = "warm_pool"
POOL_LABEL = "hedgerow.warm_pool"
_CLAIM_ATTEMPTS = 3
_NETWORK = {"none": False, "egress": True}


@dataclass(frozen=True)
class Shape:
    """What the backend bakes in at provision; a claim must match all of it."""

    image: str
    cpu_millis: int
    memory_mib: int
    network_access: bool

    def key(self) -> str:
        net = "egress" if self.network_access else "none"
        return f"{self.image}:{self.cpu_millis}m:{self.memory_mib}Mi:{net}"

    def filter(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "cpu_millis": self.cpu_millis,
            "memory_mib": self.memory_mib,
            "network_access": self.network_access,
        }


def parse_targets(value: str) -> dict[Shape, int]:
    """``"host:1000m:1024Mi:none=50,img:500m:512Mi:egress=5"`` → {Shape: count}.
    Raises ImproperlyConfigured naming the bad entry."""
    targets: dict[Shape, int] = {}
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        try:
            spec, count_text = entry.rsplit("=", 1)
            image, cpu, memory, network = spec.rsplit(":", 3)
            count = int(count_text)
            if count < 0 or not image or network not in _NETWORK:
                raise ValueError(entry)
            shape = Shape(image, parse_cpu_millis(cpu), parse_memory_mib(memory), _NETWORK[network])
        except (ValueError, QuantityError) as exc:
            raise ImproperlyConfigured(
                f"HEDGEROW_WARM_POOL entry {entry!r}: expected IMAGE:CPU:MEMORY:NETWORK=COUNT "
                f"(e.g. host:1000m:1024Mi:none=50; NETWORK is none or egress): {exc}"
            ) from None
        targets[shape] = count
    return {shape: n for shape, n in targets.items() if n > 0}


@functools.cache
def _targets_of(value: str) -> dict[Shape, int]:
    return parse_targets(value)


def warm_pool_targets() -> dict[Shape, int]:
    return _targets_of(settings.HEDGEROW_WARM_POOL)


def _backend_name(name: str | None) -> str:
    return name or settings.HEDGEROW_BACKEND


def _counter(name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}warm_pool:{name}"


def _incr(name: str) -> None:
    # Best effort: a metric must never fail a create.
    try:
        redis_client().incr(_counter(name))
    except redis.RedisError as exc:
        log.warning("warm pool counter %s not incremented: %s", name, exc)


# ---- claim (web, inside the create transaction) ------------------------------------


@dataclass(frozen=True)
class Claimed:
    member_id: uuid.UUID
    generation: int
    endpoint_host: str
    endpoint_port: int
    isolation: str
    node: str
    warm_at: datetime | None

    def sandbox_fields(self, now: datetime) -> dict[str, Any]:
        """What the claiming create writes into its ``Sandbox`` row (in ``ready``)."""
        return {
            "id": self.member_id,
            "generation": self.generation,
            "endpoint_host": self.endpoint_host,
            "endpoint_port": self.endpoint_port,
            "isolation": self.isolation,
            "node": self.node,
            "provisioning_started_at": now,
            "ready_at": now,
        }


_CLAIM_SQL = """
DELETE FROM sandboxes_warmmember WHERE id = (
    SELECT id FROM sandboxes_warmmember
    WHERE backend = %s AND image = %s AND cpu_millis = %s AND memory_mib = %s
      AND network_access = %s AND state = 'warm'
    ORDER BY warm_at LIMIT 1 FOR UPDATE SKIP LOCKED
) RETURNING id, generation, endpoint_host, endpoint_port, isolation, node, warm_at
"""


def warm_pool_claim(
    *, image: str, cpu_millis: int, memory_mib: int, network_access: bool, backend_name: str | None
) -> Claimed | None:
    """Takes one live warm member of exactly this shape, or None (cold path).

    Must run inside the create's transaction: the member's row is deleted there and
    comes back if it rolls back. Shapes without a configured target cost nothing (no
    query). A member whose process the backend no longer sees is dropped (its
    resources destroyed after commit) and the next one is tried.
    """
    shape = Shape(image, cpu_millis, memory_mib, network_access)
    if shape not in warm_pool_targets():
        return None
    backend = _backend_name(backend_name)
    for _attempt in range(_CLAIM_ATTEMPTS):
        with connection.cursor() as cursor:
            cursor.execute(_CLAIM_SQL, [backend, image, cpu_millis, memory_mib, network_access])
            row = cursor.fetchone()
        if row is None:
            break
        claimed = Claimed(uuid.UUID(str(row[0])), row[1], row[2], row[3], row[4], row[5], row[6])
        if _member_alive(claimed):
            transaction.on_commit(_claimed)
            return claimed
        log.warning(
            "warm pool member %s is dead at claim; dropped",
            claimed.member_id,
            extra={"sandbox_id": str(claimed.member_id), "event": "warm_pool_discard"},
        )
        _incr("discards")
        transaction.on_commit(functools.partial(_enqueue_destroy, claimed.member_id.hex))
    _incr("misses")
    transaction.on_commit(_claimed)
    return None


def _member_alive(claimed: Claimed) -> bool:
    """The backend's view (for the local backend: meta.json and /proc, no network):
    the member's process runs and listens where the row says."""
    try:
        endpoint = get_backend().endpoint(claimed.member_id.hex)
    except BackendError:
        return False
    return (
        endpoint is not None
        and endpoint.host == claimed.endpoint_host
        and endpoint.port == claimed.endpoint_port
    )


def _enqueue_destroy(member_hex: str) -> None:
    from apps.sandboxes.tasks import warm_member_destroy

    warm_member_destroy.delay(member_hex)


def warm_pool_record_claim(*, sandbox: Sandbox, claimed: Claimed, actor: str) -> None:
    """Inserts the claimed ``sandbox`` (not saved yet) in ``ready``, its ledger and its
    usage record in one statement, through the one writer of sandbox states
    (``lifecycle.sandbox_insert_claimed``); the transition's message names the member's
    warm time."""
    warm_since = claimed.warm_at.isoformat() if claimed.warm_at else "?"
    sandbox_insert_claimed(
        sandbox=sandbox,
        reason=CLAIM_REASON,
        message=f"claimed a warm pool member (warm since {warm_since})",
        actor=actor,
    )


# ---- refill (Celery) ---------------------------------------------------------------


def _refill_flag() -> str:
    return _counter("refill_pending")


def _last_claim_key() -> str:
    return _counter("last_claim")


def _deferred_key() -> str:
    return _counter("refill_deferred_since")


def _claimed() -> None:
    """After a claim or a miss commits: records the demand (the quiet period restarts;
    the hold-back clock starts unless it runs) and enqueues one refill for when the
    quiet period would end, unless one is pending. One Redis round trip."""
    _enqueue_refill(countdown=settings.HEDGEROW_WARM_POOL_REFILL_QUIET_S, demand=True)


def warm_pool_refill_soon() -> None:
    """Enqueues one refill check unless one is already pending (a member coming up
    calls this, to start the next while the pool is short)."""
    _enqueue_refill(countdown=0.2, demand=False)


def _enqueue_refill(*, countdown: float, demand: bool) -> None:
    if not warm_pool_targets():
        return
    from apps.sandboxes.tasks import warm_pool_refill

    try:
        pipe = redis_client().pipeline(transaction=False)
        if demand:
            now = str(time.time())
            pipe.set(_last_claim_key(), now, ex=86400)
            pipe.set(_deferred_key(), now, nx=True, ex=86400)
        pipe.set(_refill_flag(), "1", nx=True, ex=int(countdown) + 30)
        if pipe.execute()[-1]:
            warm_pool_refill.apply_async(kwargs={"chained": True}, countdown=max(countdown, 0.2))
    except Exception as exc:  # noqa: BLE001 - the beat refill is the backstop
        log.warning("warm pool refill not enqueued: %s", exc)


def warm_pool_refill_wait(*, now: float | None = None) -> float:
    """Seconds until a refill is due: 0 once claims have been quiet for
    ``HEDGEROW_WARM_POOL_REFILL_QUIET_S`` or a refill has been held back for
    ``HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S``. Without Redis: 0 (refill as before)."""
    now = time.time() if now is None else now
    try:
        values: list[Any] = redis_client().mget(_last_claim_key(), _deferred_key())  # type: ignore[assignment]
    except redis.RedisError:
        return 0.0
    last, deferred = values
    if last is None:
        return 0.0
    quiet_left = float(last) + settings.HEDGEROW_WARM_POOL_REFILL_QUIET_S - now
    if deferred is not None:
        held = float(deferred) + settings.HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S - now
        quiet_left = min(quiet_left, held)
    return max(0.0, quiet_left)


def warm_pool_refill_when_due(*, chained: bool = False) -> dict[str, int]:
    """What beat and the claims' debounced task run: ``warm_pool_refill`` if it is due
    (``warm_pool_refill_wait``), else nothing now and one check enqueued for when it
    will be, unless one is pending already. ``chained``: this is that pending check
    (it holds the pending flag and lets it go); beat's tick is not, so it never starts
    a second chain beside one. Returns {shape: members started}."""
    if not warm_pool_targets():
        return {}
    if chained:
        try:
            redis_client().delete(_refill_flag())
        except redis.RedisError:
            pass
    wait = warm_pool_refill_wait()
    if wait > 0:
        _enqueue_refill(countdown=wait, demand=False)
        return {}
    return warm_pool_refill()


def _backoff_key(shape: Shape) -> str:
    return _counter(f"backoff:{shape.key()}")


def _lock_key() -> int:
    return zlib.crc32(f"hedgerow-warm-pool:{settings.HEDGEROW_INSTANCE}".encode())


def warm_pool_supported() -> bool:
    return bool(getattr(get_backend(), "supports_warm_pool", False))


def warm_pool_refill(*, enqueue: Callable[[str], None] | None = None) -> dict[str, int]:
    """Starts members until each shape has its target (warm + warming), at most
    ``HEDGEROW_WARM_POOL_MAX_WARMING`` warming at once. Returns {shape: started}.

    Serialized by an advisory lock (a concurrent refill returns at once); a shape in
    its failure backoff is skipped. Rows are committed before their tasks are sent.
    """
    from apps.sandboxes.services.reconcile import advisory_lock

    started: dict[str, int] = {}
    targets = warm_pool_targets()
    if not targets or not warm_pool_supported():
        return started
    from apps.sandboxes.services.disk_guard import disk_shortage

    shortage = disk_shortage()
    if shortage is not None:
        log.warning("warm pool not refilled: %s", shortage)
        return started
    client = redis_client()
    try:
        # Cleared first: a member that comes up from here on enqueues a new refill.
        client.delete(_refill_flag())
    except redis.RedisError:
        pass
    backend = _backend_name(None)
    with advisory_lock(_lock_key()) as held:
        if not held:
            return started
        counts: dict[tuple[Any, ...], int] = {
            (r["image"], r["cpu_millis"], r["memory_mib"], r["network_access"], r["state"]): r["n"]
            for r in WarmMember.objects.filter(backend=backend)
            .values("image", "cpu_millis", "memory_mib", "network_access", "state")
            .annotate(n=Count("id"))
        }
        warming = sum(n for key, n in counts.items() if key[-1] == WarmMemberState.WARMING)
        slots = settings.HEDGEROW_WARM_POOL_MAX_WARMING - warming
        room = _address_room(members=sum(counts.values()))
        if room is not None and room < slots:
            if room <= 0:
                log.info("warm pool not refilled: no address of the subnet is free")
            slots = room
        short = False
        for shape, target in targets.items():
            base = (shape.image, shape.cpu_millis, shape.memory_mib, shape.network_access)
            have = counts.get((*base, "warm"), 0) + counts.get((*base, "warming"), 0)
            short = short or have < target
            want = min(target - have, slots)
            if want <= 0:
                continue
            try:
                if client.exists(_backoff_key(shape)):
                    continue
            except redis.RedisError:
                pass
            members = WarmMember.objects.bulk_create(
                [WarmMember(backend=backend, **shape.filter()) for _ in range(want)]
            )
            slots -= want
            started[shape.key()] = want
            for member in members:
                (enqueue or _enqueue_provision)(str(member.id))
        if not short:
            # At target: the hold-back clock starts again with the next claim.
            try:
                client.delete(_deferred_key())
            except redis.RedisError:
                pass
    return started


def _address_room(*, members: int) -> int | None:
    """How many more members the instance's addresses leave room for (None: no such
    bound). A member holds an address like a live sandbox, and admission counts both
    against the subnet: a member started while creates wait in the queue would take the
    address one of them waits for (and one of a shape nobody claims would keep it)."""
    capacity = address_capacity()
    if capacity is None:
        return None
    taken = Sandbox.objects.filter(state__in=[*LIVE_STATES, State.QUEUED]).count()
    return capacity - taken - members


def _enqueue_provision(member_id: str) -> None:
    from apps.sandboxes.tasks import warm_member_provision

    warm_member_provision.delay(member_id)


def warm_member_provision(*, member_id: str) -> WarmMember | None:
    """Starts one ``warming`` member and marks it ``warm`` once its agent answers.

    Idempotent: a redelivered task adopts what the backend already runs (same id and
    generation). On failure the resources and the row go, and the shape backs off.
    If the row vanished meanwhile (drained, dropped), what was started is destroyed.
    """
    from apps.sandboxes.services.provisioning import wait_agent_healthy

    member = WarmMember.objects.filter(pk=member_id, state=WarmMemberState.WARMING).first()
    if member is None:
        return None
    backend = get_backend()
    sid = member.id.hex
    token = agent_token(sid, member.generation)
    spec = SandboxSpec(
        sandbox_id=sid,
        tenant_id="",  # nobody's yet: the local backend only records it in meta.json
        generation=member.generation,
        image=member.image,
        cpu_millis=member.cpu_millis,
        memory_mib=member.memory_mib,
        network_access=member.network_access,
        agent_token=token,
        disk_mib=settings.HEDGEROW_SANDBOX_DISK_MIB,
        labels={POOL_LABEL: "member"},
    )
    shape = Shape(member.image, member.cpu_millis, member.memory_mib, member.network_access)
    try:
        endpoint = backend.provision(spec)
        wait_agent_healthy(endpoint, token, settings.HEDGEROW_READY_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure: drop the member, back off
        log.warning(
            "warm pool member %s failed to start: %s",
            sid,
            exc,
            extra={"sandbox_id": str(member.id), "event": "warm_pool_failed"},
        )
        _destroy_quietly(sid)
        WarmMember.objects.filter(pk=member.pk).delete()
        _incr("failures")
        try:
            redis_client().set(
                _backoff_key(shape), "1", ex=max(1, int(settings.HEDGEROW_WARM_POOL_BACKOFF_S))
            )
        except redis.RedisError:
            pass
        return None
    now = timezone.now()
    changed = WarmMember.objects.filter(pk=member.pk, state=WarmMemberState.WARMING).update(
        state=WarmMemberState.WARM,
        endpoint_host=endpoint.host,
        endpoint_port=endpoint.port,
        isolation=endpoint.isolation,
        node=endpoint.node,
        warm_at=now,
    )
    if changed != 1:
        _destroy_quietly(sid)  # drained or dropped while it started
        return None
    warm_pool_refill_soon()
    member.refresh_from_db()
    return member


def _destroy_quietly(member_hex: str) -> None:
    try:
        get_backend().destroy(member_hex)
    except BackendError as exc:
        log.warning("warm pool member %s not destroyed (the reconciler will): %s", member_hex, exc)


def warm_member_destroy(*, member_hex: str) -> None:
    """Destroys a dropped member's resources, unless its id is (now) a sandbox's."""
    if Sandbox.objects.filter(pk=uuid.UUID(hex=member_hex)).exists():
        return
    get_backend().destroy(member_hex)


# ---- reconcile, audit, shutdown ----------------------------------------------------


def warm_pool_member_ids() -> set[uuid.UUID]:
    return set(WarmMember.objects.values_list("id", flat=True))


def warm_pool_drop_vanished(*, running_ids: set[uuid.UUID], listed_at: datetime) -> dict[str, int]:
    """The reconciler's part: a ``warm`` member the backend no longer runs is dropped
    (residue destroyed); a ``warming`` one past the pending deadline too (its task was
    lost). Members claimed meanwhile are sandboxes now and are not touched here."""
    dropped = {"pool_member_vanished": 0, "pool_member_stuck": 0}
    deadline = listed_at - timedelta(seconds=settings.HEDGEROW_PENDING_TIMEOUT_S)
    candidates = WarmMember.objects.filter(state=WarmMemberState.WARM, warm_at__lt=listed_at)
    for member_id in candidates.values_list("id", flat=True):
        if member_id in running_ids:
            continue
        if WarmMember.objects.filter(pk=member_id, state=WarmMemberState.WARM).delete()[0]:
            _destroy_quietly(member_id.hex)
            dropped["pool_member_vanished"] += 1
    stuck = WarmMember.objects.filter(state=WarmMemberState.WARMING, created_at__lt=deadline)
    for member_id in stuck.values_list("id", flat=True):
        if WarmMember.objects.filter(pk=member_id, state=WarmMemberState.WARMING).delete()[0]:
            _destroy_quietly(member_id.hex)
            dropped["pool_member_stuck"] += 1
    return {k: v for k, v in dropped.items() if v}


def warm_pool_drain() -> int:
    """Removes every member (shutdown, ``hedgerow_backend_cleanup``). Returns how many."""
    count = 0
    for member_id in list(WarmMember.objects.values_list("id", flat=True)):
        if WarmMember.objects.filter(pk=member_id).delete()[0]:
            _destroy_quietly(member_id.hex)
            count += 1
    return count


def warm_pool_forget() -> int:
    """Deletes every member row without touching the backend (the caller destroys
    every resource anyway: ``hedgerow_backend_cleanup``). Returns how many."""
    deleted, _ = WarmMember.objects.all().delete()
    return deleted


def warm_pool_stats() -> dict[str, Any]:
    """Gauges for /metrics: members by shape and state; misses, discards and start
    failures (Redis counters since the counters' start). Claims are counted from the
    ledger by the metrics' fold (``apps/sandboxes/metrics.py``)."""
    by_shape: dict[tuple[str, str], int] = {}
    for row in (
        WarmMember.objects.values("image", "cpu_millis", "memory_mib", "network_access", "state")
        .annotate(n=Count("id"))
        .order_by()
    ):
        shape = Shape(row["image"], row["cpu_millis"], row["memory_mib"], row["network_access"])
        by_shape[(shape.key(), row["state"])] = row["n"]
    counters: dict[str, int] = {}
    try:
        client = redis_client()
        for name in ("misses", "discards", "failures"):
            value = client.get(_counter(name))
            counters[name] = int(value) if value else 0  # type: ignore[arg-type]
    except redis.RedisError as exc:
        log.warning("warm pool counters unavailable: %s", exc)
    return {"members": by_shape, **counters}
