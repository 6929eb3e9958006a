"""Metering, driven by the lifecycle: the usage ledger follows the sandbox's own ledger.

A record opens at the sandbox's first ``→ provisioning`` transition (the moment it
starts to hold resources; a warm-pool claim's ``requested → ready``) and closes at its
first ``→ deleted/failed/lost``. A sandbox that failed while provisioning is billed for
the time it held resources; one deleted while still requested or queued never held any
and has no record.

Billing owns the price books, the ledger tables and what a record costs over a window
(``apps.billing.usage``, ``apps.billing.pricing``); this module knows *when* a sandbox
holds resources and writes the rows through them. The lifecycle calls it directly
(``services/lifecycle.py``, ``services/warm_pool.py``); ledger rows written through the
ORM reach ``on_sandbox_event`` by the ``post_save`` hook this app connects in
``apps.py``. Billing never imports sandboxes (the import contract says so).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.billing.models import CapacityType, PriceBook, PriceRate, UsageRecord
from apps.billing.pricing import hourly_rate, price_book_in_force, price_rate
from apps.billing.storage import storage_cost_for_sandboxes
from apps.billing.usage import (
    capacity_type_of,
    daily_usage_invalidate,
    record_window,
    usage_records_of,
)
from apps.sandboxes.admission.queue import queue_order
from apps.sandboxes.models import FINAL_STATES, Sandbox, SandboxEvent, State

log = logging.getLogger(__name__)


_RECORDS = UsageRecord._meta.db_table


WARM_POOL_REASON = "warm_pool"  # apps.sandboxes.services.warm_pool.CLAIM_REASON


def usage_record_sync(
    *, sandbox_id: uuid.UUID | str, event: SandboxEvent | None = None
) -> UsageRecord | None:
    """Makes the sandbox's usage record agree with its lifecycle ledger. Idempotent.

    Opens the record (pricing it with the book in force at the start), fills in the
    node once known and closes it at the terminal transition. Never reprices.
    ``event``: the transition the ledger hook is syncing for. Its sandbox instance is
    the one the transition just moved (fields applied in memory), which saves reading
    the row again, and only a move to a final state can close the record.
    """
    sandbox = None
    if event is not None and SandboxEvent.sandbox.is_cached(event):
        sandbox = event.sandbox
    if sandbox is None:
        sandbox = Sandbox.objects.filter(pk=sandbox_id).first()
    if sandbox is None:
        return None
    transitions = SandboxEvent.objects.filter(sandbox_id=sandbox.pk, event="transition")
    record = UsageRecord.objects.filter(sandbox_id=sandbox.pk).first()
    changed = record is None
    since = None  # the earliest instant this sync changes the record's billed time at
    if record is None:
        # Provisioning is entered once (only from ``requested``, itself entered only
        # from ``queued``): the event that moves there is the start. A sandbox that
        # claimed a warm pool member goes requested → ready directly: metering
        # starts at that claim.
        first_move = event is not None and (
            event.to_state == State.PROVISIONING
            or (event.to_state == State.READY and event.reason == WARM_POOL_REASON)
        )
        if first_move:
            started: SandboxEvent | None = event
        else:
            started = (
                transitions.filter(to_state__in=(State.PROVISIONING, State.READY))
                .order_by("at", "id")
                .first()
            )
        if started is None:
            return None
        capacity = capacity_type_of(sandbox.labels)
        book = price_book_in_force(at=started.at)
        rate = price_rate(book=book, capacity_type=capacity)
        record = UsageRecord(
            sandbox=sandbox,
            tenant_id=sandbox.tenant_id,
            image=sandbox.image,
            backend=sandbox.backend,
            labels=dict(sandbox.labels),
            capacity_type=capacity,
            cpu_millis=sandbox.cpu_millis,
            memory_mib=sandbox.memory_mib,
            started_at=started.at,
            price_book=book,
            hourly_rate=hourly_rate(
                cpu_millis=sandbox.cpu_millis, memory_mib=sandbox.memory_mib, rate=rate
            ),
            startup_fee=rate.startup_fee,
        )
        since = started.at
    if sandbox.node and sandbox.node != record.node:
        record.node = sandbox.node
        changed = True
    may_end = event is None or event.to_state in FINAL_STATES or sandbox.state in FINAL_STATES
    if record.ended_at is None and may_end:
        ended = transitions.filter(to_state__in=FINAL_STATES).order_by("at", "id").first()
        if ended is not None:
            record.ended_at = ended.at
            record.end_state = ended.to_state
            record.end_reason = ended.reason
            changed = True
            since = min(since or ended.at, ended.at)
    if changed:
        record.save()
        # A record opened or closed after the fact (the repair sweep) changes finished
        # days whose roll-up may already be final: the report reads them from the
        # records again until the roll-up task rebuilds them.
        if since is not None:
            daily_usage_invalidate(since=since)
    return record


@dataclass(frozen=True)
class UsageWrite:
    """The usage ledger's share of one lifecycle transition, folded into the
    transition's own statement (``services/lifecycle.py``): ``sql`` is a data-modifying
    statement over ``moved`` — the sandbox row the compare-and-set just moved (id,
    tenant_id, image, backend, node, labels, cpu_millis, memory_mib) — that returns one
    row per usage record it wrote. ``drain_check``: the sandbox ended, so the statement
    also says whether anything waits in the admission queue."""

    sql: str | None
    params: tuple[Any, ...]
    drain_check: bool

    # The admission-queue check that ``_drain_if_queued`` makes after commit, read in
    # the transition's statement instead: the same answer for any create queued before
    # it, and one queued by a transaction that commits later is admitted by the sweep
    # either way (``HEDGEROW_ADMISSION_SWEEP_S``).
    # Names from the models only, no input: not an injection.
    DRAIN_SQL = (
        f'EXISTS (SELECT 1 FROM "{Sandbox._meta.db_table}" '  # noqa: S608
        f"WHERE \"state\" = '{State.QUEUED.value}')"
    )


def usage_write_for_transition(
    *, sandbox: Sandbox, from_state: str, to_state: str, reason: str, at: datetime
) -> UsageWrite | None:
    """What a transition ``from_state → to_state`` at ``at`` writes to the usage ledger,
    as SQL for the transition's statement, so the transition, its ledger row and its
    metering are one round trip and commit together.

    * ``→ provisioning`` opens the record, priced by the book in force at ``at``
      (looked up in the statement, ``_OPEN_SQL``).
    * ``→ ready`` fills in the node.
    * the first move into a final state closes the record with this transition (a final
      state is never left, so it is the sandbox's one end).

    The statement's parts cannot fail on metering data: the insert skips a record that
    exists, the updates match zero or one row; a metering problem never blocks a
    lifecycle transition. ``usage_after_transition`` repairs a record that was not
    where it was expected.
    """
    if to_state == State.PROVISIONING:
        return UsageWrite(*open_record_sql(sandbox=sandbox, at=at), drain_check=False)
    if to_state == State.READY:
        if not sandbox.node:
            return None
        return UsageWrite(
            f'UPDATE "{_RECORDS}" AS u SET "node" = m."node" FROM moved AS m '  # noqa: S608
            'WHERE u."sandbox_id" = m."id" RETURNING 1',
            (),
            drain_check=False,
        )
    if to_state in FINAL_STATES and from_state not in FINAL_STATES:
        return UsageWrite(
            f'UPDATE "{_RECORDS}" AS u '  # noqa: S608 - table name from the model
            'SET "node" = COALESCE(NULLIF(m."node", \'\'), u."node"), '
            '"ended_at" = %s, "end_state" = %s, "end_reason" = %s FROM moved AS m '
            'WHERE u."sandbox_id" = m."id" AND u."ended_at" IS NULL RETURNING 1',
            (at, to_state, reason),
            drain_check=True,
        )
    if to_state in FINAL_STATES:
        return UsageWrite(None, (), drain_check=True)
    return None


_BOOKS = PriceBook._meta.db_table


_RATES = PriceRate._meta.db_table


# Opens the record priced by the book in force at the start, in the statement: the
# newest non-reference book with effective_from ≤ start (``price_book_in_force``), its
# row for the capacity type or else its on-demand row (``price_rate``), and
# ``hourly_rate``'s formula in numeric. Postgres's numeric division by 1000 and 1024 is
# exact, as Python's Decimal is, and the column rounds the exact value as it does for
# the ORM's save. No book or no row: nothing is inserted (zero rows), and
# ``usage_after_transition`` opens it the ORM's way, which recreates the default books
# or logs why it cannot.
_OPEN_SQL = (
    f'INSERT INTO "{_RECORDS}" ("sandbox_id", "tenant_id", "image", "backend", "node", '  # noqa: S608
    '"labels", "capacity_type", "cpu_millis", "memory_mib", "started_at", "ended_at", '
    '"end_state", "end_reason", "price_book_id", "hourly_rate", "startup_fee", "pauses") '
    'SELECT m."id", m."tenant_id", m."image", m."backend", m."node", m."labels", %s, '
    'm."cpu_millis", m."memory_mib", %s, NULL, \'\', \'\', r."price_book_id", '
    'm."cpu_millis"::numeric / 1000 * r."vcpu_hour" '
    '+ m."memory_mib"::numeric / 1024 * r."gib_hour", r."startup_fee", \'[]\'::jsonb '
    "FROM moved AS m CROSS JOIN LATERAL ("
    f'SELECT rate.* FROM "{_RATES}" AS rate WHERE rate."price_book_id" = ('
    f'SELECT b."id" FROM "{_BOOKS}" AS b WHERE NOT b."is_reference" '
    'AND b."effective_from" <= %s ORDER BY b."effective_from" DESC, b."version" DESC '
    'LIMIT 1) AND rate."capacity_type" IN (%s, %s) '
    'ORDER BY rate."capacity_type" = %s DESC LIMIT 1) AS r '
    # Past the column's 12 integer digits the ORM's save would raise; here the row is
    # left out instead, so the transition never fails on it (the ORM's way then logs).
    'WHERE m."cpu_millis"::numeric / 1000 * r."vcpu_hour" '
    '+ m."memory_mib"::numeric / 1024 * r."gib_hour" < 1e12 '
    'ON CONFLICT ("sandbox_id") DO NOTHING RETURNING 1'
)


def open_record_sql(*, sandbox: Sandbox, at: datetime) -> tuple[str, tuple[Any, ...]]:
    """``_OPEN_SQL`` and its parameters: opens ``sandbox``'s usage record started at
    ``at``, over a CTE named ``moved`` (the row's id, tenant_id, image, backend, node,
    labels, cpu_millis, memory_mib). Used by transitions and by the warm pool's claim."""
    capacity = capacity_type_of(sandbox.labels)
    return _OPEN_SQL, (capacity, at, at, capacity, CapacityType.ON_DEMAND.value, capacity)


def usage_after_transition(
    *, sandbox: Sandbox, to_state: str, written: int | None, queue_waiting: bool
) -> None:
    """After a transition's statement: repair a record that was not where the write
    expected it (missing because a hook was skipped, or already closed) from the
    ledger, and let the admission queue use capacity a sandbox freed."""
    if written == 0:
        try:
            with transaction.atomic():
                usage_record_sync(sandbox_id=sandbox.pk)
        except Exception as exc:  # noqa: BLE001 - the sweep retries
            log.warning("usage record sync failed: %s", exc, extra={"sandbox_id": str(sandbox.pk)})
    if queue_waiting:
        transaction.on_commit(_enqueue_drain)


def on_sandbox_event(event: SandboxEvent) -> None:
    """Ledger hook (post_save of SandboxEvent, inside the transition's transaction), for
    ledger rows written through the ORM. ``sandbox_transition`` writes its own usage in
    its statement (``usage_write_for_transition``) and does not come here."""
    if event.event != "transition":
        return
    if event.to_state in (State.PROVISIONING, State.READY, *FINAL_STATES):
        # A savepoint: a metering bug must never roll back a lifecycle transition; the
        # periodic sweep repairs whatever was skipped.
        try:
            with transaction.atomic():
                if not _record_follow(event):
                    usage_record_sync(sandbox_id=event.sandbox_id, event=event)
        except Exception as exc:  # noqa: BLE001 - see above; the sweep retries
            log.warning(
                "usage record sync failed: %s", exc, extra={"sandbox_id": str(event.sandbox_id)}
            )
    if event.to_state in FINAL_STATES:
        transaction.on_commit(_drain_if_queued)


def _record_follow(event: SandboxEvent) -> bool:
    """The usual transitions after the record was opened, as one UPDATE each instead of
    a read and a save of the whole record: ``ready`` fills in the node, a final state
    closes the record with this event. False (nothing written) when the record is not
    as expected — missing (a hook missed, repaired by the sweep), already closed, no
    node known — and ``usage_record_sync`` then works it out from the ledger.

    A final state is never left (no transition starts from one), so a move into one
    from a live state is the sandbox's first and only end: the event itself is the
    "first final transition" ``usage_record_sync`` would look up.
    """
    sandbox = event.sandbox if SandboxEvent.sandbox.is_cached(event) else None
    if sandbox is None or not sandbox.node:
        return False
    records = UsageRecord.objects.filter(sandbox_id=event.sandbox_id)
    if event.to_state == State.READY:
        return records.update(node=sandbox.node) == 1
    if event.to_state in FINAL_STATES and event.from_state not in FINAL_STATES:
        return (
            records.filter(ended_at__isnull=True).update(
                node=sandbox.node,
                ended_at=event.at,
                end_state=event.to_state,
                end_reason=event.reason,
            )
            == 1
        )
    return False


def _drain_if_queued() -> None:
    """A sandbox ended: let the admission queue use the freed capacity. Nothing queued
    (the usual case) costs one indexed read instead of a task. A create queued by a
    transaction that commits after this read is admitted by the periodic sweep
    (``HEDGEROW_ADMISSION_SWEEP_S``)."""
    if Sandbox.objects.filter(state=State.QUEUED).exists():
        _enqueue_drain()


def _enqueue_drain() -> None:
    from apps.sandboxes.tasks import admission_drain

    admission_drain.delay()


def usage_sweep(*, limit: int = 2000, full: bool = False, now: datetime | None = None) -> int:
    """Repairs records the hook missed: billable sandboxes without a record, and open
    records whose sandbox has ended. Returns how many it synced.

    The minutely sweep (``full=False``) looks only at sandboxes the ledger shows moving
    (to provisioning, ready or an end) in the last ``HEDGEROW_USAGE_SWEEP_LOOKBACK_S``:
    the ledger's ``at`` index makes that read follow the rate of change, not the
    number of sandboxes live or ever created (it anti-joined every sandbox row each
    minute). ``full=True`` (daily, ``usage-sweep-full``) checks every sandbox: the
    backstop for a sweep that was down longer than the look-back."""
    if full:
        missing = Sandbox.objects.filter(
            provisioning_started_at__isnull=False, usage__isnull=True
        ).values_list("pk", flat=True)[:limit]
        stale = UsageRecord.objects.filter(
            ended_at__isnull=True, sandbox__state__in=FINAL_STATES
        ).values_list("sandbox_id", flat=True)[:limit]
        candidates = [*missing, *stale]
    else:
        since = (now or timezone.now()) - timedelta(
            seconds=settings.HEDGEROW_USAGE_SWEEP_LOOKBACK_S
        )
        moved = (
            SandboxEvent.objects.filter(
                at__gte=since,
                event="transition",
                to_state__in=(State.PROVISIONING, State.READY, *FINAL_STATES),
            )
            .order_by()
            .values_list("sandbox_id", flat=True)
            .distinct()
        )
        ids = list(moved[: limit * 2])
        has_record = dict(
            UsageRecord.objects.filter(sandbox_id__in=ids).values_list("sandbox_id", "ended_at")
        )
        ended = set(
            Sandbox.objects.filter(pk__in=ids, state__in=FINAL_STATES).values_list("pk", flat=True)
        )
        candidates = [
            pk for pk in ids if pk not in has_record or (has_record[pk] is None and pk in ended)
        ]
    synced = 0
    for sandbox_id in candidates:
        with transaction.atomic():
            if usage_record_sync(sandbox_id=sandbox_id) is not None:
                synced += 1
    return synced


def sandbox_cost(*, sandbox: Sandbox, now: datetime | None = None) -> Decimal | None:
    """Cost so far of one sandbox (live ones accrue); None if it never held resources."""
    record = UsageRecord.objects.filter(sandbox_id=sandbox.pk).first()
    if record is None:
        return None
    now = now or timezone.now()
    cost = record_window(record, start=None, end=None, now=now).cost
    if _was_paused(sandbox):
        kept = storage_cost_for_sandboxes(sandbox_ids=[sandbox.pk], now=now)
        cost += kept.get(sandbox.pk, Decimal(0))
    return cost


def _was_paused(sandbox: Sandbox) -> bool:
    """Whether the sandbox may have kept a pause (its state billed as storage): paused
    now, or provisioned more than once (a resume is a new generation). A sandbox
    provisioned once never paused, so its cost needs no storage read."""
    return sandbox.state == State.PAUSED or (sandbox.generation or 0) > 1


def sandbox_window_cost(*, sandbox: Sandbox, start: datetime, end: datetime) -> Decimal:
    """Cost of ``sandbox`` inside [start, end) (startup fee if it started inside).
    The API the trajectories area uses for cost per episode."""
    record = UsageRecord.objects.filter(sandbox_id=sandbox.pk).first()
    if record is None:
        return Decimal(0)
    return record_window(record, start=start, end=end, now=timezone.now()).cost


@dataclass(frozen=True)
class SandboxBilling:
    queue_position: int | None
    cost: Decimal | None


def sandbox_billing(*, sandboxes: Iterable[Sandbox]) -> dict[uuid.UUID, SandboxBilling]:
    """Queue position and cost so far for a page of sandboxes in at most three queries
    (the API's list would otherwise pay one per sandbox for each)."""
    rows = list(sandboxes)
    now = timezone.now()
    # A record opens at → provisioning: a queued or requested sandbox has none yet
    # (a fresh create's answer then costs no query).
    billable = [s for s in rows if s.state not in (State.QUEUED, State.REQUESTED)]
    records = {}
    if billable:
        records = {r.sandbox_id: r for r in usage_records_of(sandbox_ids=[s.pk for s in billable])}
    positions: dict[str, int] = {}
    if any(s.state == State.QUEUED for s in rows):
        positions = {pk: i + 1 for i, (pk, _) in enumerate(queue_order())}
    paused = [s.pk for s in billable if _was_paused(s)]
    storage: dict[uuid.UUID, Decimal] = {}
    if paused:
        storage = storage_cost_for_sandboxes(sandbox_ids=paused)
    out = {}
    for sandbox in rows:
        record = records.get(sandbox.pk)
        cost = None
        if record is not None:
            cost = record_window(record, start=None, end=None, now=now).cost
            cost += storage.get(sandbox.pk, Decimal(0))
        position = positions.get(str(sandbox.pk)) if sandbox.state == State.QUEUED else None
        out[sandbox.pk] = SandboxBilling(queue_position=position, cost=cost)
    return out
