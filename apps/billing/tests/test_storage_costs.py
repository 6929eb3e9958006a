"""Paused sandboxes bill storage, not compute; snapshots bill per GiB-hour (issue 16).
Costs from hand-fixed ledger timestamps, checked by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from apps.billing.models import PriceBook, PriceRate, StorageRecord, TenantQuota, UsageRecord
from apps.billing.pricing import money
from apps.billing.quotas import quota_get
from apps.billing.reports import tenant_report
from apps.billing.storage import storage_window_cost
from apps.billing.tests.test_costs import ledger_sandbox
from apps.billing.usage import (
    record_window,
    tenant_window_cost,
    tenant_window_totals,
    usage_pause_begin,
    usage_pause_end,
)
from apps.sandboxes.admission.use import storage_shortfall
from apps.sandboxes.metering.storage import (
    snapshot_bytes_in_use,
    storage_record_close,
    storage_record_open,
    storage_sweep,
)
from apps.sandboxes.metering.usage import sandbox_billing, sandbox_cost
from apps.sandboxes.models import Sandbox, Snapshot

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 3, 10, 10, 0, 0, tzinfo=UTC)
GIB = 1 << 30


@pytest.fixture
def book():
    b = PriceBook.objects.create(
        slug="hedgerow", name="test", version=2, effective_from=datetime(2026, 1, 1, tzinfo=UTC)
    )
    PriceRate.objects.create(
        price_book=b,
        capacity_type="on_demand",
        vcpu_hour=Decimal("0.10"),
        gib_hour=Decimal("0.01"),
        startup_fee=Decimal("0.05"),
        storage_gib_hour=Decimal("0.001"),
    )
    return b


def _snapshot(sandbox, *, size, captured, kind="snapshot", state="ready"):
    return Snapshot.objects.create(
        tenant_id=sandbox.tenant_id,
        sandbox=sandbox,
        kind=kind,
        state=state,
        backend="local",
        image="host",
        size_bytes=size,
        ttl_seconds=86400,
        expires_at=captured + timedelta(days=1),
        created_at=captured,
        captured_at=captured,
    )


def _delete(snapshot, at):
    Snapshot.objects.filter(pk=snapshot.pk).update(state="deleted", deleted_at=at)
    snapshot.refresh_from_db()
    storage_record_close(snapshot=snapshot)


def _paused_then_resumed(tenant):
    """2 vCPU, 4 GiB (0.24/h): provisioning at T0, paused (compute released) at +3610,
    resumed at +10810 (2 h later), deleted at +12610. A 2 GiB pause kept 2 h."""
    sandbox = ledger_sandbox(
        tenant,
        T0,
        [
            ("provisioning", 0),
            ("ready", 10),
            ("paused", 3600),
            ("requested", 10810),
            ("provisioning", 10811),
            ("ready", 10812),
            ("terminating", 12600),
            ("deleted", 12610),
        ],
    )
    Sandbox.objects.filter(pk=sandbox.pk).update(generation=2)
    sandbox.refresh_from_db()
    assert usage_pause_begin(sandbox_id=sandbox.pk, at=T0 + timedelta(seconds=3610))
    pause = _snapshot(sandbox, size=2 * GIB, captured=T0 + timedelta(seconds=3610), kind="pause")
    storage_record_open(snapshot=pause)
    assert usage_pause_end(sandbox_id=sandbox.pk, at=T0 + timedelta(seconds=10810))
    _delete(pause, T0 + timedelta(seconds=10810))
    return sandbox, pause


def test_a_paused_sandbox_is_billed_for_its_state_not_for_cpu_and_memory(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox, pause = _paused_then_resumed(tenant)
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert record.pauses == [
        [(T0 + timedelta(seconds=3610)).isoformat(), (T0 + timedelta(seconds=10810)).isoformat()]
    ]
    # compute: 12610 s − 7200 s paused = 5410 s × 0.24/h + 0.05 startup fee
    compute = Decimal(5410) / 3600 * Decimal("0.24") + Decimal("0.05")
    assert record_window(record, start=None, end=None, now=T0 + timedelta(days=1)).cost == compute
    # storage: 2 GiB × 2 h × 0.001 = 0.004
    (kept,) = StorageRecord.objects.filter(snapshot=pause)
    assert (kept.kind, kept.size_bytes, kept.gib_hour) == ("pause", 2 * GIB, Decimal("0.001"))
    assert kept.ended_at == T0 + timedelta(seconds=10810)
    assert sandbox_cost(sandbox=sandbox) == compute + Decimal("0.004")
    assert sandbox_billing(sandboxes=[sandbox])[sandbox.pk].cost == compute + Decimal("0.004")
    # a window inside the pause: the 10 s before it only, no compute while paused
    inside = record_window(
        record, start=T0 + timedelta(seconds=3600), end=T0 + timedelta(seconds=7200), now=T0
    )
    assert inside.seconds == Decimal(10)


def test_the_window_sum_in_sql_leaves_out_pauses_and_adds_storage(make_tenant, book):
    tenant, _ = make_tenant()
    _paused_then_resumed(tenant)
    ledger_sandbox(tenant, T0, [("provisioning", 7), ("deleted", 5413)])  # never paused
    start, now = T0 - timedelta(hours=1), T0 + timedelta(hours=5)
    by_record = tenant_window_totals(tenant=tenant, start=start, end=now).cost
    storage = storage_window_cost(tenant=tenant, start=start, now=now)
    assert storage == Decimal("0.004")
    in_sql = tenant_window_cost(tenant=tenant, start=start, now=now)
    assert in_sql.quantize(Decimal("1e-12")) == (by_record + storage).quantize(Decimal("1e-12"))
    # by hand: 5410 s and 5406 s at 0.24/h, two startup fees, 0.004 of storage
    by_hand = Decimal(5410 + 5406) / 3600 * Decimal("0.24") + Decimal("0.10") + Decimal("0.004")
    assert money(in_sql) == money(by_hand) == Decimal("0.83")  # 0.72107 + 0.10 + 0.004


def test_an_open_pause_accrues_no_compute_while_its_state_accrues_storage(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 10), ("paused", 100)])
    assert usage_pause_begin(sandbox_id=sandbox.pk, at=T0 + timedelta(seconds=100))
    assert usage_pause_begin(sandbox_id=sandbox.pk, at=T0 + timedelta(seconds=500))  # idempotent
    pause = _snapshot(sandbox, size=GIB, captured=T0 + timedelta(seconds=100), kind="pause")
    storage_record_open(snapshot=pause)
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert len(record.pauses) == 1 and record.pauses[0][1] is None
    later = T0 + timedelta(hours=10, seconds=100)
    share = record_window(record, start=None, end=None, now=later)
    assert share.seconds == Decimal(100)  # only the time before the pause
    # 1 GiB kept 10 h at 0.001
    assert storage_window_cost(tenant=tenant, start=T0, now=later) == Decimal("0.01")
    assert tenant_report(tenant=tenant, start=T0, end=later).as_dict()["storage"]["pause"] == {
        "gib_hours": "10.0000",
        "cost": "0.01",
    }


def test_storage_is_priced_by_the_book_in_force_at_capture_and_never_repriced(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 1)])
    before = _snapshot(sandbox, size=GIB, captured=T0)
    storage_record_open(snapshot=before)
    newer = PriceBook.objects.create(
        slug="hedgerow", name="dearer", version=3, effective_from=T0 + timedelta(hours=1)
    )
    PriceRate.objects.create(
        price_book=newer,
        capacity_type="on_demand",
        vcpu_hour=Decimal("0.10"),
        gib_hour=Decimal("0.01"),
        storage_gib_hour=Decimal("0.01"),
    )
    after = _snapshot(sandbox, size=GIB, captured=T0 + timedelta(hours=2))
    storage_record_open(snapshot=after)
    assert StorageRecord.objects.get(snapshot=before).gib_hour == Decimal("0.001")
    assert StorageRecord.objects.get(snapshot=after).gib_hour == Decimal("0.01")
    _delete(before, T0 + timedelta(hours=3))
    _delete(after, T0 + timedelta(hours=3))
    # 3 h × 1 GiB × 0.001 + 1 h × 1 GiB × 0.01
    assert storage_window_cost(tenant=tenant, start=T0, now=T0 + timedelta(days=1)) == Decimal(
        "0.013"
    )


def test_the_sweep_opens_missing_and_closes_unclosed_storage_records(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 1)])
    missing = _snapshot(sandbox, size=GIB, captured=T0)
    unclosed = _snapshot(sandbox, size=GIB, captured=T0)
    storage_record_open(snapshot=unclosed)
    Snapshot.objects.filter(pk=unclosed.pk).update(
        state="deleted", deleted_at=T0 + timedelta(hours=1)
    )
    never = _snapshot(sandbox, size=0, captured=T0, state="failed")
    # the minutely sweep looks back 15 minutes: today, both changes are older
    assert storage_sweep() == 0
    # ...ten minutes after the capture it sees both (the deletion is later still)
    assert storage_sweep(now=T0 + timedelta(minutes=10)) == 2
    assert StorageRecord.objects.get(snapshot=missing).ended_at is None
    assert StorageRecord.objects.get(snapshot=unclosed).ended_at == T0 + timedelta(hours=1)
    assert not StorageRecord.objects.filter(snapshot=never).exists()
    assert storage_sweep(full=True) == 0


def test_the_daily_storage_sweep_repairs_what_the_look_back_missed(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 1)])
    missing = _snapshot(sandbox, size=GIB, captured=T0)
    assert storage_sweep() == 0  # captured long before the look-back
    assert storage_sweep(full=True) == 1
    assert StorageRecord.objects.get(snapshot=missing).ended_at is None
    assert storage_sweep(full=True) == 0


def test_the_storage_quota_counts_kept_snapshots_and_pauses(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 1)])
    _snapshot(sandbox, size=GIB, captured=T0)
    _snapshot(sandbox, size=GIB, captured=T0, kind="pause")
    _snapshot(sandbox, size=5 * GIB, captured=T0, state="deleted")  # freed
    _snapshot(sandbox, size=5 * GIB, captured=T0, state="failed")  # never kept
    assert snapshot_bytes_in_use(tenant_id=tenant.pk) == 2 * GIB
    assert storage_shortfall(tenant=tenant, adding=GIB) is None  # unlimited
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_snapshot_bytes=3 * GIB)
    assert storage_shortfall(tenant=tenant) is None
    assert storage_shortfall(tenant=tenant, adding=GIB) is None  # exactly at the limit
    over = storage_shortfall(tenant=tenant, adding=GIB + 1)
    assert over is not None and over.status_code == 429
    assert over.as_dict()["error"] | {"message": ""} == {
        "code": "quota_exceeded",
        "message": "",
        "field": None,
        "limit": "max_snapshot_bytes",
        "value": 3 * GIB,
        "current": 2 * GIB,
    }
    TenantQuota.objects.filter(tenant=tenant).update(max_snapshot_bytes=2 * GIB)
    full = storage_shortfall(tenant=tenant)  # a new capture of unknown size: refused
    assert full is not None and full.extra["limit"] == "max_snapshot_bytes"


def test_the_usage_page_shows_kept_state_apart_from_compute(make_tenant, client, book):
    from django.contrib.auth.models import User

    from apps.tenancy.services import membership_set_role

    tenant, _ = make_tenant()
    _paused_then_resumed(tenant)  # a 2 GiB pause kept 2 h: 4 GiB-h, $0.004
    user = User.objects.create_user("ivy", password="pw")
    membership_set_role(tenant=tenant, user=user, role="viewer")
    client.force_login(user)
    page = client.get("/billing/usage/", {"start": "2026-03-01", "end": "2026-03-31"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "paused sandboxes 4.00 GiB-h, $0.00." in html
    assert "snapshots 0 GiB-h, $0.00;" in html
