"""The storage ledger: what kept state costs (snapshots and the pauses of paused
sandboxes), per GiB-hour from versioned price books (docs/billing.md, "Storage").

A record opens when a snapshot becomes ``ready`` (its size is known then) and closes
when it is deleted; a capture that failed kept nothing and is never billed. The price
is the in-force book's on-demand ``storage_gib_hour`` at the capture, captured on the
record like a sandbox's hourly rate, so a later book never reprices kept bytes.

    cost = hours kept × size GiB × storage_gib_hour
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.db.models import QuerySet, Sum
from django.utils import timezone

from apps.billing.intervals import overlapping
from apps.billing.models import CapacityType, StorageRecord
from apps.billing.pricing import HOUR, price_book_in_force, price_rate, seconds_of
from apps.sandboxes.models import Snapshot, SnapshotState
from apps.tenancy.models import Tenant

GIB = Decimal(1 << 30)
# Snapshots whose bytes are kept (or about to be): what the storage quota counts.
KEPT_STATES = (SnapshotState.CAPTURING, SnapshotState.READY)


def storage_record_open(*, snapshot: Snapshot) -> StorageRecord | None:
    """Opens the snapshot's record at its capture (idempotent; None if it was never
    captured). A snapshot already deleted gets its record closed at once."""
    if snapshot.captured_at is None:
        return None
    record = StorageRecord.objects.filter(snapshot_id=snapshot.pk).first()
    if record is None:
        book = price_book_in_force(at=snapshot.captured_at)
        rate = price_rate(book=book, capacity_type=CapacityType.ON_DEMAND)
        try:
            with transaction.atomic():
                record = StorageRecord.objects.create(
                    snapshot_id=snapshot.pk,
                    tenant_id=snapshot.tenant_id,
                    sandbox_id=snapshot.sandbox_id,
                    kind=snapshot.kind,
                    size_bytes=snapshot.size_bytes,
                    started_at=snapshot.captured_at,
                    price_book=book,
                    gib_hour=rate.storage_gib_hour,
                )
        except IntegrityError:  # a concurrent caller opened it
            record = StorageRecord.objects.get(snapshot_id=snapshot.pk)
    if snapshot.state == SnapshotState.DELETED and record.ended_at is None:
        storage_record_close(snapshot=snapshot)
        record.refresh_from_db()
    return record


def storage_record_close(*, snapshot: Snapshot) -> None:
    """Closes the snapshot's record at its deletion (idempotent; no record: nothing)."""
    at = snapshot.deleted_at or timezone.now()
    StorageRecord.objects.filter(snapshot_id=snapshot.pk, ended_at__isnull=True).update(ended_at=at)


def storage_sweep(*, limit: int = 2000) -> int:
    """Repairs what a crashed worker left: captured snapshots without a record, and
    open records of deleted snapshots. Returns how many it synced."""
    missing = Snapshot.objects.filter(captured_at__isnull=False, storage__isnull=True).exclude(
        state=SnapshotState.FAILED
    )[:limit]
    stale = Snapshot.objects.filter(
        state=SnapshotState.DELETED, storage__ended_at__isnull=True, storage__isnull=False
    )[:limit]
    synced = 0
    for snapshot in [*missing, *stale]:
        if storage_record_open(snapshot=snapshot) is not None:
            synced += 1
    return synced


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


def snapshot_bytes_in_use(*, tenant_id: uuid.UUID | str) -> int:
    """Bytes of the tenant's kept snapshots (pauses included): the storage quota's use.
    A capture still running counts 0 until its size is known."""
    row = Snapshot.objects.filter(tenant_id=tenant_id, state__in=KEPT_STATES).aggregate(
        n=Sum("size_bytes")
    )
    return int(row["n"] or 0)
