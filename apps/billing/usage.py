"""The usage ledger's money side: what records cost over any window, per sandbox and
per tenant, and the pauses that stop a record accruing.

The records are written by the sandboxes app's metering
(``apps/sandboxes/metering/usage.py``), which follows the lifecycle ledger: a record
opens at the sandbox's first ``→ provisioning`` transition (the moment it
starts to hold resources) and closes at its first ``→ deleted/failed/lost``. A sandbox
that failed while provisioning is billed for the time it held resources; one deleted
while still requested or queued never held any and has no record.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.db.models import (
    Case,
    DateTimeField,
    DecimalField,
    DurationField,
    ExpressionWrapper,
    F,
    Func,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from apps.billing.intervals import overlapping
from apps.billing.models import CapacityType, DailyUsageDay, UsageRecord
from apps.billing.pricing import HOUR, gibs
from apps.billing.pricing import seconds_of as _seconds_of
from apps.billing.pricing import vcpus as _vcpus
from apps.billing.storage import storage_window_cost
from apps.core.dbrows import instance_from_row, select_list
from apps.tenancy.models import Tenant

log = logging.getLogger(__name__)
SPOT_LABEL = "capacity"  # labels {"capacity": "spot"} bill at the spot row


def capacity_type_of(labels: dict[str, Any]) -> str:
    return CapacityType.SPOT if labels.get(SPOT_LABEL) == "spot" else CapacityType.ON_DEMAND


@dataclass(frozen=True)
class WindowUsage:
    """One record's share of a window."""

    seconds: Decimal
    cost: Decimal
    started_inside: bool


def record_window(
    record: UsageRecord, *, start: datetime | None, end: datetime | None, now: datetime
) -> WindowUsage:
    """Billable seconds and cost of ``record`` inside [start, end); open records accrue
    up to ``now``."""
    lo = max(record.started_at, start) if start else record.started_at
    stop = record.ended_at or now
    hi = min(stop, end) if end else stop
    seconds = _seconds_of(hi - lo) if hi > lo else Decimal(0)
    if seconds and record.pauses:
        seconds -= paused_seconds(record, lo=lo, hi=hi, stop=stop)
    started_inside = (start is None or record.started_at >= start) and (
        end is None or record.started_at < end
    )
    cost = seconds / HOUR * record.hourly_rate
    if started_inside:
        cost += record.startup_fee
    return WindowUsage(seconds=seconds, cost=cost, started_inside=started_inside)


def pause_intervals(record: UsageRecord, *, stop: datetime) -> list[tuple[datetime, datetime]]:
    """The record's intervals without compute, an open one ending at ``stop`` (the
    record's end, or now)."""
    out = []
    for begin, finish in record.pauses or []:
        lo = datetime.fromisoformat(begin)
        hi = min(datetime.fromisoformat(finish), stop) if finish else stop
        if hi > lo:
            out.append((lo, hi))
    return out


def paused_seconds(record: UsageRecord, *, lo: datetime, hi: datetime, stop: datetime) -> Decimal:
    """Seconds of [lo, hi) the record's sandbox was paused (no compute held)."""
    total = Decimal(0)
    for p_lo, p_hi in pause_intervals(record, stop=stop):
        a, b = max(p_lo, lo), min(p_hi, hi)
        if b > a:
            total += _seconds_of(b - a)
    return total


def usage_pause_begin(*, sandbox_id: uuid.UUID | str, at: datetime) -> bool:
    """A paused sandbox released its compute at ``at``: from then on its usage record
    accrues nothing (its state is billed as storage). Idempotent: a pause already open
    is left alone. False when the sandbox has no record."""
    with transaction.atomic():
        record = UsageRecord.objects.select_for_update().filter(sandbox_id=sandbox_id).first()
        if record is None:
            return False
        pauses = list(record.pauses or [])
        if pauses and pauses[-1][1] is None:
            return True
        pauses.append([at.isoformat(), None])
        UsageRecord.objects.filter(pk=record.pk).update(pauses=pauses)
        daily_usage_invalidate(since=at)
    return True


def usage_pause_end(*, sandbox_id: uuid.UUID | str, at: datetime) -> bool:
    """A paused sandbox was resumed at ``at`` (admitted again: it holds compute from
    here): closes its open pause. False when none was open."""
    with transaction.atomic():
        record = UsageRecord.objects.select_for_update().filter(sandbox_id=sandbox_id).first()
        if record is None or not record.pauses or record.pauses[-1][1] is not None:
            return False
        pauses = [list(p) for p in record.pauses]
        pauses[-1][1] = max(at, datetime.fromisoformat(pauses[-1][0])).isoformat()
        UsageRecord.objects.filter(pk=record.pk).update(pauses=pauses)
        daily_usage_invalidate(since=at)
    return True


def records_overlapping(
    *, start: datetime | None, end: datetime | None, tenant: Tenant | None = None
) -> QuerySet[UsageRecord]:
    return overlapping(UsageRecord.objects.all(), start=start, end=end, tenant=tenant)


@dataclass
class Totals:
    sandboxes: int = 0
    sandbox_seconds: Decimal = Decimal(0)
    vcpu_seconds: Decimal = Decimal(0)
    gib_seconds: Decimal = Decimal(0)
    cost: Decimal = Decimal(0)

    def add(self, record: UsageRecord, share: WindowUsage) -> None:
        self.sandboxes += 1 if share.started_inside else 0
        self.sandbox_seconds += share.seconds
        self.vcpu_seconds += share.seconds * _vcpus(record.cpu_millis)
        self.gib_seconds += share.seconds * gibs(record.memory_mib)
        self.cost += share.cost


def tenant_window_totals(*, tenant: Tenant, start: datetime, end: datetime | None = None) -> Totals:
    """Usage and cost of one tenant in [start, end), live sandboxes accrued to now."""
    now = timezone.now()
    totals = Totals()
    for record in records_overlapping(start=start, end=end, tenant=tenant).iterator():
        totals.add(record, record_window(record, start=start, end=end, now=now))
    return totals


def month_start(at: datetime) -> datetime:
    return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


class EpochSeconds(Func):
    template = "EXTRACT(EPOCH FROM %(expressions)s)"
    output_field = DecimalField(max_digits=30, decimal_places=6)


def tenant_window_cost(*, tenant: Tenant, start: datetime, now: datetime | None = None) -> Decimal:
    """Cost of one tenant from ``start`` to now in one SQL aggregate (the admission
    check runs it on every create, so no per-record Python). Same arithmetic as
    ``record_window``: overlap seconds × hourly rate / 3600 + fees of starts inside."""
    now = now or timezone.now()
    stop = Value(now, output_field=DateTimeField())
    lo = Greatest(F("started_at"), Value(start, output_field=DateTimeField()))
    hi = Least(Coalesce(F("ended_at"), stop), stop)
    seconds = EpochSeconds(ExpressionWrapper(hi - lo, output_field=DurationField()))
    money_field: DecimalField[Decimal, Decimal] = DecimalField(max_digits=30, decimal_places=12)
    row = records_overlapping(start=start, end=now, tenant=tenant).aggregate(
        running=Sum(
            ExpressionWrapper(seconds * F("hourly_rate") / Value(HOUR), output_field=money_field)
        ),
        fees=Sum(
            Case(
                When(started_at__gte=start, then=F("startup_fee")),
                default=Value(Decimal(0)),
                output_field=money_field,
            )
        ),
    )
    paused = Decimal(0)
    for record in records_overlapping(start=start, end=now, tenant=tenant).exclude(pauses=[]):
        until = min(record.ended_at or now, now)
        since = max(record.started_at, start)
        paused += paused_seconds(record, lo=since, hi=until, stop=until) / HOUR * record.hourly_rate
    storage = storage_window_cost(tenant=tenant, start=start, now=now)
    return Decimal(row["running"] or 0) + Decimal(row["fees"] or 0) - paused + storage


def tenant_month_cost(*, tenant: Tenant, at: datetime | None = None) -> Decimal:
    """Month-to-date cost (UTC calendar month), including live accrual."""
    at = at or timezone.now()
    return tenant_window_cost(tenant=tenant, start=month_start(at), now=at)


def cost_for_sandboxes(
    *,
    sandbox_ids: Iterable[uuid.UUID | str],
    start: datetime | None = None,
    end: datetime | None = None,
) -> dict[str, Decimal]:
    """Unrounded cost per sandbox (keyed by str(Sandbox.pk)) inside an optional window;
    sandboxes that never held resources cost 0. One query."""
    ids = [str(i) for i in sandbox_ids]
    now = timezone.now()
    costs = dict.fromkeys(ids, Decimal(0))
    for record in UsageRecord.objects.filter(sandbox_id__in=ids):
        costs[str(record.sandbox_id)] = record_window(record, start=start, end=end, now=now).cost
    return costs


def usage_records_of(*, sandbox_ids: list[uuid.UUID]) -> list[UsageRecord]:
    """``UsageRecord.objects.filter(sandbox_id__in=sandbox_ids)`` as one statement built
    once: every wait, GET and delete of a running sandbox renders its cost, and the
    ORM's build and compile of this read was ~0.4 ms of web CPU each (py-spy,
    docs/benchmarks.md). A test holds it to the ORM's answer."""
    table = UsageRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            # Identifiers only from the model's metadata.
            f'SELECT {select_list(UsageRecord)} FROM "{table}" WHERE sandbox_id = ANY(%s)',  # noqa: S608
            [sandbox_ids],
        )
        rows = cursor.fetchall()
    return [instance_from_row(UsageRecord, row) for row in rows]


# How long after its event time a write to the usage ledger may come and still count as
# on time. The roll-up of the open day cuts it this long before the oldest transaction
# in flight (``daily_usage_rebuild``), so an on-time write it could not see falls after
# its cut and is read from the records; a write later than this (the repair sweep, a
# record opened or closed after the fact) marks the days it changes stale instead.
LATE_WRITE = timedelta(seconds=60)


def daily_usage_invalidate(*, since: datetime, now: datetime | None = None) -> int:
    """A record of the usage ledger changed at ``since`` (opened, closed, or a pause
    moved): the days from ``since`` whose roll-up may already hold that moment are no
    longer final (``DailyUsageDay``) until the roll-up rebuilds them — the finished days
    to yesterday, and today too when the write is late (``since`` more than
    ``LATE_WRITE`` ago: today's partial roll-up may have been cut after it). An on-time
    change today needs nothing (it falls after today's cut, read from the records).
    Returns days marked."""
    now = now or timezone.now()
    today = now.date()
    last = today if since < now - LATE_WRITE else today - timedelta(days=1)
    if since.date() > last:
        return 0
    return DailyUsageDay.objects.filter(day__gte=since.date(), day__lte=last).update(
        stale=True, version=F("version") + 1
    )
