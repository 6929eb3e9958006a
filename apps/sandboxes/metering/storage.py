"""Metering of kept state, driven by the snapshots: a snapshot's storage record opens at
its capture and closes at its deletion (``services/snapshots.py``; the sweep repairs
what a crashed worker left). What a record costs is billing's
(``apps.billing.storage``); when it starts and stops is the snapshot's."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Sum
from django.utils import timezone

from apps.billing.models import CapacityType, StorageRecord
from apps.billing.pricing import price_book_in_force, price_rate
from apps.sandboxes.models import Snapshot, SnapshotState

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


def storage_sweep(*, limit: int = 2000, full: bool = False, now: datetime | None = None) -> int:
    """Repairs what a crashed worker left: captured snapshots without a record, and
    open records of deleted snapshots. Returns how many it synced.

    The minutely sweep (``full=False``) looks only at snapshots captured or deleted in
    the last ``HEDGEROW_USAGE_SWEEP_LOOKBACK_S`` (both stamps are set to the time of
    the change, just before the record is opened or closed, and each has a partial
    index): its read follows the rate of captures and deletions, not the number of
    snapshots ever kept (it anti-joined every snapshot each minute). ``full=True``
    (daily, with the usage sweep's) checks every snapshot: the backstop for a sweep
    that was down longer than the look-back."""
    missing = Snapshot.objects.filter(captured_at__isnull=False, storage__isnull=True).exclude(
        state=SnapshotState.FAILED
    )
    stale = Snapshot.objects.filter(
        state=SnapshotState.DELETED, storage__ended_at__isnull=True, storage__isnull=False
    )
    if not full:
        since = (now or timezone.now()) - timedelta(
            seconds=settings.HEDGEROW_USAGE_SWEEP_LOOKBACK_S
        )
        missing = missing.filter(captured_at__gte=since)
        stale = stale.filter(deleted_at__gte=since)
    synced = 0
    for snapshot in [*missing[:limit], *stale[:limit]]:
        if storage_record_open(snapshot=snapshot) is not None:
            synced += 1
    return synced


def snapshot_bytes_in_use(*, tenant_id: uuid.UUID | str) -> int:
    """Bytes of the tenant's kept snapshots (pauses included): the storage quota's use.
    A capture still running counts 0 until its size is known."""
    row = Snapshot.objects.filter(tenant_id=tenant_id, state__in=KEPT_STATES).aggregate(
        n=Sum("size_bytes")
    )
    return int(row["n"] or 0)
