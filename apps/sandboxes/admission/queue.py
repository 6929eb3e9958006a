"""The admission queue: creates that asked to wait start in order when capacity frees.

Order is round-robin by tenant (see ``queue_order``), so a tenant with 500 queued
rollouts cannot starve one with 5. Within a tenant it is FIFO.
Whether a create starts or waits is decided by ``admission_decide`` (``__init__.py``).
Draining runs on every sandbox end (a task enqueued after commit by the metering,
``metering/usage.py``) and periodically (``tasks.admission_sweep``); one drain at a
time (a Postgres session advisory lock).
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max
from django.utils import timezone

from apps.billing.errors import BudgetExhausted
from apps.billing.quotas import Ask, check_budget, quota_lock_for
from apps.sandboxes.admission.use import CLUSTER_LIMITS, capacity_shortfall, cluster_capped
from apps.sandboxes.models import Sandbox, SandboxEvent, State

log = logging.getLogger(__name__)
DRAIN_LOCK_KEY = 0x48455251  # "HERQ"


def queue_order(*, limit: int = 5000) -> list[tuple[str, str]]:
    """(sandbox pk, tenant pk) of queued sandboxes in admission order.

    Tenants take turns, least recently served by the queue first (never served: by
    their oldest waiting sandbox); each turn admits a tenant's oldest waiting one. The
    turn order remembers past admissions (the ledger's ``admitted`` events), so a
    tenant with a long queue cannot win every turn just by having queued first.
    """
    rows = list(
        Sandbox.objects.filter(state=State.QUEUED)
        .order_by("created_at", "id")
        .values_list("pk", "tenant_id", "created_at")[:limit]
    )
    per_tenant: dict[str, list[str]] = {}
    heads: dict[str, datetime] = {}
    for pk, tenant_id, created_at in rows:
        per_tenant.setdefault(str(tenant_id), []).append(str(pk))
        heads.setdefault(str(tenant_id), created_at)
    served = dict(
        SandboxEvent.objects.filter(
            event="transition", reason="admitted", tenant_id__in=list(per_tenant)
        )
        .values("tenant_id")
        .annotate(last=Max("at"))
        .values_list("tenant_id", "last")
    )
    never = datetime.min.replace(tzinfo=UTC)
    turns = sorted(per_tenant, key=lambda t: (served.get(uuid.UUID(t), never) or never, heads[t]))
    order: list[tuple[str, str]] = []
    depth = max((len(v) for v in per_tenant.values()), default=0)
    for round_ in range(depth):
        for turn in turns:
            waiting = per_tenant[turn]
            if round_ < len(waiting):
                order.append((waiting[round_], turn))
    return order


def queue_position(*, sandbox: Sandbox) -> int | None:
    """1-based place in the global admission order; None unless queued."""
    if sandbox.state != State.QUEUED:
        return None
    for index, (pk, _) in enumerate(queue_order()):
        if pk == str(sandbox.pk):
            return index + 1
    return None


def _try_admit(sandbox_pk: str) -> str:
    """One queued sandbox, in its own transaction: 'admitted', 'tenant_full',
    'cluster_full', 'failed' (budget) or 'gone'."""
    from apps.sandboxes.services.lifecycle import sandbox_transition
    from apps.sandboxes.tasks import provision_sandbox

    with transaction.atomic():
        sandbox = Sandbox.objects.select_related("tenant").filter(pk=sandbox_pk).first()
        if sandbox is None or sandbox.state != State.QUEUED:
            return "gone"
        quota, key_max = quota_lock_for(
            tenant=sandbox.tenant, actor=sandbox.created_by, cluster=cluster_capped()
        )
        try:
            check_budget(quota=quota)
        except BudgetExhausted as exc:
            sandbox_transition(
                sandbox=sandbox,
                from_states=(State.QUEUED,),
                to_state=State.FAILED,
                reason="budget_exhausted",
                actor="admission",
                message=exc.message,
                terminated_at=timezone.now(),
            )
            return "failed"
        ask = Ask(
            cpu_millis=sandbox.cpu_millis,
            memory_mib=sandbox.memory_mib,
            ttl_seconds=sandbox.ttl_seconds,
            actor=sandbox.created_by,
        )
        shortfall = capacity_shortfall(quota=quota, ask=ask, key_max_sandboxes=key_max)
        if shortfall is not None:
            full = shortfall.extra.get("limit") in CLUSTER_LIMITS
            return "cluster_full" if full else "tenant_full"
        now = timezone.now()
        moved = sandbox_transition(
            sandbox=sandbox,
            from_states=(State.QUEUED,),
            to_state=State.REQUESTED,
            reason="admitted",
            actor="admission",
            admitted_at=now,
            # TTL and heartbeat clocks start at admission: waiting is not running.
            expires_at=now + timedelta(seconds=sandbox.ttl_seconds),
            last_heartbeat_at=now,
        )
        if not moved:
            return "gone"
        transaction.on_commit(lambda: provision_sandbox.delay(sandbox_pk))
        return "admitted"


def admission_queue_drain() -> int:
    """Admits queued sandboxes in fair order while capacity allows. Returns how many.

    A tenant at its limit is skipped (its later sandboxes too, keeping its FIFO); a
    full cluster stops the pass. If another drain holds the lock this one returns 0:
    that drain, or the periodic sweep, will see the capacity freed meanwhile.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [DRAIN_LOCK_KEY])
        got = cursor.fetchone()
    if not got or not got[0]:
        return 0
    admitted = 0
    try:
        blocked: set[str] = set()
        for sandbox_pk, tenant_pk in queue_order():
            if tenant_pk in blocked:
                continue
            outcome = _try_admit(sandbox_pk)
            if outcome == "admitted":
                admitted += 1
            elif outcome == "tenant_full":
                blocked.add(tenant_pk)
            elif outcome == "cluster_full":
                break
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [DRAIN_LOCK_KEY])
    return admitted


def admission_queue_expire() -> int:
    """Fails sandboxes queued longer than HEDGEROW_QUEUE_TIMEOUT_S (reason
    ``queue_timeout``) so a forgotten queue does not start work hours later."""
    from apps.sandboxes.services.lifecycle import sandbox_transition

    deadline = timezone.now() - timedelta(seconds=settings.HEDGEROW_QUEUE_TIMEOUT_S)
    expired = 0
    for sandbox in Sandbox.objects.filter(state=State.QUEUED, created_at__lt=deadline):
        if sandbox_transition(
            sandbox=sandbox,
            from_states=(State.QUEUED,),
            to_state=State.FAILED,
            reason="queue_timeout",
            actor="admission",
            message="not admitted before the queue timeout",
            terminated_at=timezone.now(),
        ):
            expired += 1
    return expired
