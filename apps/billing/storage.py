"""The storage ledger: what kept state costs (snapshots and the pauses of paused
sandboxes), per GiB-hour from versioned price books (docs/billing.md, "Storage").

A record opens when a snapshot becomes ``ready`` (its size is known then) and closes
when it is deleted; a capture that failed kept nothing and is never billed. The price
is the in-force book's on-demand ``storage_gib_hour`` at the capture, captured on the
record like a sandbox's hourly rate, so a later book never reprices kept bytes.

    cost = hours kept × size GiB × storage_gib_hour

Records are opened and closed by the snapshots' metering
(``apps/sandboxes/metering/storage.py``); this module prices them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal

from django.db.models import QuerySet
from django.utils import timezone

from apps.billing.intervals import overlapping
from apps.billing.models import StorageRecord
from apps.billing.pricing import HOUR, seconds_of
from apps.tenancy.models import Tenant

GIB = Decimal(1 << 30)


def record_storage_window(
    record: StorageRecord, *, start: datetime | None, end: datetime | None, now: datetime
) -> tuple[Decimal, Decimal]:
    """``(GiB-seconds, cost)`` of the record inside [start, end); open ones accrue to now."""
    lo = max(record.started_at, start) if start else record.started_at
    stop = record.ended_at or now
    hi = min(stop, end) if end else stop
    if hi <= lo:
        return Decimal(0), Decimal(0)
    gib_seconds = seconds_of(hi - lo) * Decimal(record.size_bytes) / GIB
    return gib_seconds, gib_seconds / HOUR * record.gib_hour


def storage_overlapping(
    *, start: datetime | None, end: datetime | None, tenant: Tenant | None = None
) -> QuerySet[StorageRecord]:
    return overlapping(StorageRecord.objects.all(), start=start, end=end, tenant=tenant)


def storage_window_cost(*, tenant: Tenant, start: datetime, now: datetime | None = None) -> Decimal:
    """Storage cost of one tenant from ``start`` to now (budget checks, usage)."""
    now = now or timezone.now()
    total = Decimal(0)
    for record in storage_overlapping(start=start, end=now, tenant=tenant):
        total += record_storage_window(record, start=start, end=now, now=now)[1]
    return total


def storage_totals(
    *, tenant: Tenant, start: datetime, end: datetime | None = None
) -> dict[str, dict[str, Decimal]]:
    """``{"gib_hours", "cost"}`` per kind (``snapshot``, ``pause``) and in total, for the
    usage report."""
    now = timezone.now()
    out = {
        kind: {"gib_hours": Decimal(0), "cost": Decimal(0)}
        for kind in ("snapshot", "pause", "total")
    }
    for record in storage_overlapping(start=start, end=end, tenant=tenant):
        gib_s, cost = record_storage_window(record, start=start, end=end, now=now)
        for kind in (record.kind if record.kind in out else "snapshot", "total"):
            out[kind]["gib_hours"] += gib_s / HOUR
            out[kind]["cost"] += cost
    return out


def storage_cost_for_snapshots(*, snapshot_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Decimal]:
    """Storage cost so far per snapshot (one query; never captured: absent)."""
    now = timezone.now()
    return {
        record.snapshot_id: record_storage_window(record, start=None, end=None, now=now)[1]
        for record in StorageRecord.objects.filter(snapshot_id__in=list(snapshot_ids))
    }


def storage_cost_for_sandboxes(
    *, sandbox_ids: Iterable[uuid.UUID], now: datetime | None = None
) -> dict[uuid.UUID, Decimal]:
    """Cost so far of the state each sandbox's pauses kept (one query): a paused
    sandbox is billed for this, not for CPU and memory."""
    now = now or timezone.now()
    out: dict[uuid.UUID, Decimal] = {}
    records = StorageRecord.objects.filter(sandbox_id__in=list(sandbox_ids), kind="pause")
    for record in records:
        cost = record_storage_window(record, start=None, end=None, now=now)[1]
        out[record.sandbox_id] = out.get(record.sandbox_id, Decimal(0)) + cost
    return out
