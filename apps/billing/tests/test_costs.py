"""Costs to the cent, from lifecycle-ledger timestamps fixed by hand."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from apps.billing.models import DailyUsage, PriceBook, PriceRate, UsageRecord
from apps.billing.pricing import money, reference_books
from apps.billing.reports import cost_report, daily_usage_rebuild, tenant_report
from apps.billing.usage import cost_for_sandboxes, tenant_window_totals
from apps.sandboxes.metering.usage import sandbox_cost
from apps.sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 3, 10, 10, 0, 0, tzinfo=UTC)


def ledger_sandbox(
    tenant,
    t0,
    steps,
    *,
    cpu_millis=2000,
    memory_mib=4096,
    image="host",
    labels=None,
    reason_last="",
):
    """A sandbox whose ledger says: created at t0, then each (to_state, +seconds)."""
    final = steps[-1][0]
    sandbox = Sandbox.objects.create(
        tenant=tenant,
        external_id=f"sb-{Sandbox.objects.count() + 1}",
        state=final,
        image=image,
        cpu_millis=cpu_millis,
        memory_mib=memory_mib,
        labels=labels or {},
        ttl_seconds=3600,
        expires_at=t0 + timedelta(hours=1),
        backend="local",
        created_at=t0,
    )
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=tenant, at=t0, event="created", to_state="requested", reason="api"
    )
    previous = "requested"
    for index, (state, offset) in enumerate(steps):
        last = index == len(steps) - 1
        SandboxEvent.objects.create(
            sandbox=sandbox,
            tenant=tenant,
            at=t0 + timedelta(seconds=offset),
            event="transition",
            from_state=previous,
            to_state=state,
            reason=reason_last if last else "",
        )
        previous = state
    return sandbox


def _cost(sandbox):
    cost = sandbox_cost(sandbox=sandbox)
    assert cost is not None
    return cost


@pytest.fixture
def book():
    """A price book in force from 2026-01-01 with round prices for hand-checking."""
    b = PriceBook.objects.create(
        slug="hedgerow", name="test", version=2, effective_from=datetime(2026, 1, 1, tzinfo=UTC)
    )
    PriceRate.objects.create(
        price_book=b,
        capacity_type="on_demand",
        vcpu_hour=Decimal("0.10"),
        gib_hour=Decimal("0.01"),
        startup_fee=Decimal("0.05"),
    )
    PriceRate.objects.create(
        price_book=b,
        capacity_type="spot",
        vcpu_hour=Decimal("0.03"),
        gib_hour=Decimal("0.003"),
        startup_fee=Decimal("0.05"),
    )
    return b


def test_it_bills_a_ttl_reaped_sandbox_from_provisioning_start_to_deletion(make_tenant, book):
    tenant, _ = make_tenant()
    # requested at 10:00:00, provisioning 10:00:02, ready 10:00:05, reaped (TTL) at
    # 11:30:02 → terminating, deleted at 11:30:04: billable 10:00:02 → 11:30:04 = 5402 s.
    sandbox = ledger_sandbox(
        tenant, T0, [("provisioning", 2), ("ready", 5), ("terminating", 5402), ("deleted", 5404)]
    )
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert (record.started_at, record.ended_at) == (
        T0 + timedelta(seconds=2),
        T0 + timedelta(seconds=5404),
    )
    assert record.end_state == "deleted" and record.price_book == book
    # 2 vCPU × 0.10 + 4 GiB × 0.01 = 0.24/h; 5402 s = 1.500555… h → 0.360133… + 0.05
    cost = sandbox_cost(sandbox=sandbox)
    assert cost == Decimal(5402) / 3600 * Decimal("0.24") + Decimal("0.05")
    assert money(cost) == Decimal("0.41")


def test_it_bills_a_sandbox_that_failed_while_provisioning_for_the_time_it_held(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(
        tenant,
        T0,
        [("provisioning", 1), ("failed", 121)],
        cpu_millis=1000,
        memory_mib=1024,
        reason_last="provision_error",
    )
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert (record.end_state, record.end_reason) == ("failed", "provision_error")
    # 120 s × (1 × 0.10 + 1 × 0.01)/h = 0.003666… + 0.05 startup fee
    assert money(_cost(sandbox)) == Decimal("0.05")
    assert sandbox_cost(sandbox=sandbox) == Decimal(120) / 3600 * Decimal("0.11") + Decimal("0.05")


def test_it_never_bills_a_sandbox_deleted_before_it_held_resources(make_tenant, book):
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("terminating", 3), ("deleted", 4)])
    assert sandbox_cost(sandbox=sandbox) is None
    assert not UsageRecord.objects.filter(sandbox=sandbox).exists()


def test_it_prices_spot_at_the_spot_row_and_keeps_the_price_it_started_with(make_tenant, book):
    tenant, _ = make_tenant()
    spot = ledger_sandbox(
        tenant,
        T0,
        [("provisioning", 0), ("deleted", 36000)],
        cpu_millis=4000,
        memory_mib=8192,
        labels={"capacity": "spot"},
    )
    # 10 h × (4 × 0.03 + 8 × 0.003) = 10 × 0.144 = 1.44 + 0.05
    assert money(_cost(spot)) == Decimal("1.49")
    newer = PriceBook.objects.create(
        slug="hedgerow", name="pricier", version=3, effective_from=T0 + timedelta(hours=1)
    )
    PriceRate.objects.create(price_book=newer, vcpu_hour=Decimal("1"), gib_hour=Decimal("1"))
    assert money(_cost(spot)) == Decimal("1.49")  # never repriced
    later = ledger_sandbox(
        tenant,
        T0 + timedelta(hours=2),
        [("provisioning", 0), ("deleted", 1800)],
        cpu_millis=1000,
        memory_mib=1024,
    )
    assert money(_cost(later)) == Decimal("1.00")  # 0.5 h × (1 + 1) + 0


def test_it_accrues_a_live_sandbox_up_to_now(make_tenant, book):
    from django.utils import timezone

    tenant, _ = make_tenant()
    start = timezone.now() - timedelta(hours=2)
    sandbox = ledger_sandbox(tenant, start, [("provisioning", 0), ("ready", 3)])
    cost = sandbox_cost(sandbox=sandbox)
    assert cost is not None
    # ≥ 2 h × 0.24 + 0.05 = 0.53, and still open
    assert Decimal("0.53") <= cost < Decimal("0.54")
    assert UsageRecord.objects.get(sandbox=sandbox).ended_at is None


def test_it_splits_cost_across_days_windows_and_reports(make_tenant, book):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    # 22:00 → 02:00 next day, 2 vCPU + 4 GiB (0.24/h): 2 h each side of midnight.
    night = datetime(2026, 3, 10, 22, 0, tzinfo=UTC)
    a = ledger_sandbox(
        tenant,
        night,
        [("provisioning", 0), ("deleted", 4 * 3600)],
        image="python",
        labels={"exp": "rl-1"},
    )
    b = ledger_sandbox(
        other, T0, [("provisioning", 0), ("deleted", 3600)], cpu_millis=1000, memory_mib=1024
    )
    day1, _ = datetime(2026, 3, 10, tzinfo=UTC), None
    totals = tenant_window_totals(tenant=tenant, start=day1, end=day1 + timedelta(days=1))
    assert money(totals.cost) == Decimal("0.53")  # 2 h × 0.24 + fee (started that day)
    # total, image, label, price book, creating key, peak concurrency
    assert daily_usage_rebuild(day=date(2026, 3, 11)) == 6
    row = DailyUsage.objects.get(tenant=tenant, day=date(2026, 3, 11), dimension="total")
    assert money(row.cost) == Decimal("0.48") and row.sandboxes == 0
    assert row.vcpu_seconds == Decimal(2 * 7200)
    assert DailyUsage.objects.get(dimension="label", value="exp=rl-1").cost == row.cost
    daily_usage_rebuild(day=date(2026, 3, 11))  # idempotent
    assert DailyUsage.objects.filter(day=date(2026, 3, 11)).count() == 6

    costs = cost_for_sandboxes(sandbox_ids=[a.pk, b.pk])
    assert {k: money(v) for k, v in costs.items()} == {
        str(a.pk): Decimal("1.01"),
        str(b.pk): Decimal("0.16"),
    }
    report = tenant_report(tenant=tenant, start=day1, end=day1 + timedelta(days=2))
    data = report.as_dict()
    assert data["totals"]["cost"] == "1.01" and data["totals"]["vcpu_hours"] == "8.0000"
    assert [d["cost"] for d in data["days"]] == ["0.53", "0.48"]
    # 8 vCPU-h and 16 GiB-h at list prices: E2B/Daytona 8×0.0504 + 16×0.0162 = 0.6624;
    # Modal 8×0.070956 + 16×0.024192 = 0.954720.
    assert {r["slug"]: r["cost"] for r in data["hosted_comparison"]} == {
        "e2b": "0.66",
        "daytona": "0.66",
        "modal": "0.95",
    }
    rows = cost_report(start=day1, end=day1 + timedelta(days=2), sort="cost")
    assert [r["cost"] for r in rows] == [Decimal("0.16"), Decimal("1.01")]
    assert rows[1]["price_books"] == "hedgerow v2"


def test_it_sums_a_window_in_sql_exactly_as_record_by_record(make_tenant, book):
    from apps.billing.usage import tenant_window_cost

    tenant, _ = make_tenant()
    ledger_sandbox(tenant, T0, [("provisioning", 7), ("deleted", 5413)])
    ledger_sandbox(tenant, T0 - timedelta(days=2), [("provisioning", 0), ("ready", 2)])  # open
    ledger_sandbox(tenant, T0, [("provisioning", 1), ("failed", 95)], cpu_millis=250)
    start, now = T0 - timedelta(hours=1), T0 + timedelta(hours=5, seconds=13)
    by_record = tenant_window_totals(tenant=tenant, start=start, end=now).cost
    in_sql = tenant_window_cost(tenant=tenant, start=start, now=now)
    # Postgres divides at its own scale: equal to 1e-12 dollars, far below a cent.
    assert in_sql.quantize(Decimal("1e-12")) == by_record.quantize(Decimal("1e-12"))
    assert money(in_sql) == money(by_record) == Decimal("1.90")


def test_it_recreates_the_default_price_books_when_none_exist(make_tenant):
    PriceRate.objects.all().delete()
    PriceBook.objects.all().delete()
    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", 3600)])
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert str(record.price_book) == "hedgerow v1"
    # 2 vCPU × 0.04 + 4 GiB × 0.005 = 0.10/h for 1 h + 0.0005
    assert _cost(sandbox) == Decimal("0.1005")
    assert sorted(b.slug for b in reference_books(at=T0)) == ["daytona", "e2b", "modal"]


def test_it_repairs_a_missing_or_unclosed_record_from_the_ledger(make_tenant, book):
    from apps.billing.tasks import usage_rollup
    from apps.sandboxes.tasks import usage_sweep

    tenant, _ = make_tenant()
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", 3600)])
    Sandbox.objects.filter(pk=sandbox.pk).update(provisioning_started_at=T0)
    UsageRecord.objects.filter(sandbox=sandbox).delete()  # the hook's write was lost
    assert usage_sweep() == 0  # the minutely sweep: this ledger moved months ago
    assert usage_sweep(full=True) == 1  # the daily one sees every sandbox
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert record.ended_at == T0 + timedelta(hours=1) and money(_cost(sandbox)) == Decimal("0.29")
    UsageRecord.objects.filter(sandbox=sandbox).update(ended_at=None, end_state="")
    assert usage_sweep(full=True) == 1  # the sandbox ended but the record stayed open
    assert UsageRecord.objects.get(sandbox=sandbox).end_state == "deleted"
    # total, image, price book, creating key and peak concurrency (no labels)
    assert usage_rollup(day="2026-03-10") == 5


def test_it_reads_usage_records_as_the_orm_does_and_prices_them_alike(make_tenant, book):
    from apps.billing.usage import usage_records_of
    from apps.sandboxes.metering.usage import sandbox_billing

    tenant, _ = make_tenant()
    live = ledger_sandbox(
        tenant, T0, [("provisioning", 0), ("ready", 3)], labels={"capacity": "spot"}
    )
    ended = ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 3), ("deleted", 3600)])
    never = ledger_sandbox(tenant, T0, [("deleted", 5)])  # never held resources
    ids = [live.pk, ended.pk, never.pk]
    fields = [f.attname for f in UsageRecord._meta.concrete_fields]
    got = {r.sandbox_id: r for r in usage_records_of(sandbox_ids=ids)}
    orm = {r.sandbox_id: r for r in UsageRecord.objects.filter(sandbox_id__in=ids)}
    assert set(got) == set(orm) == {live.pk, ended.pk}
    for pk, record in got.items():
        assert {f: getattr(record, f) for f in fields} == {f: getattr(orm[pk], f) for f in fields}
    assert got[live.pk].labels == {"capacity": "spot"} and got[live.pk].ended_at is None
    billing = sandbox_billing(sandboxes=[live, ended, never])
    assert billing[ended.pk].cost == _cost(ended)
    assert billing[live.pk].cost is not None and billing[never.pk].cost is None
    assert usage_records_of(sandbox_ids=[]) == []
