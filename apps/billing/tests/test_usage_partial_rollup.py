"""Today's partial roll-up (issue 20, the usage report over a history written today):
the roll-up task cuts the open day (``rollup_cut``) and the report reads [midnight, cut)
from ``DailyUsage`` and only the records after the cut. Exact: the report equals the
walk of every record with a partial roll-up, with a late write before and after it, an
on-time write after it, and a write in flight while the roll-up reads."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from apps.billing.models import DailyUsageDay, PriceBook, UsageRecord
from apps.billing.reports import (
    _peak_sweep_walk,
    _window_days,
    cost_by_key,
    cost_by_key_walk,
    daily_usage_rebuild,
    day_bounds,
    peak_concurrency,
    rollup_cut,
    tenant_report,
    tenant_report_walk,
)
from apps.billing.tasks import usage_rollup
from apps.billing.tests.test_costs import book, ledger_sandbox  # noqa: F401 (fixture)
from apps.billing.usage import LATE_WRITE, usage_pause_begin, usage_pause_end
from apps.sandboxes.metering.usage import usage_record_sync
from apps.sandboxes.models import Sandbox

NOW = datetime(2026, 3, 10, 15, 0, 0, tzinfo=UTC)  # mid-afternoon: today has a past


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, datetime]:
    """``timezone.now`` as a settable clock (report, walk and roll-up read the same)."""
    at = {"now": NOW}
    monkeypatch.setattr(timezone, "now", lambda: at["now"])
    return at


def _today(tenant: Any, now: datetime) -> dict[str, Sandbox]:
    midnight = day_bounds(now.date())[0]
    out = {
        # across last midnight, closed this morning
        "night": ledger_sandbox(
            tenant,
            midnight - timedelta(hours=2),
            [("provisioning", 0), ("deleted", 5 * 3600)],
            labels={"exp": "a"},
        ),
        # live since yesterday: part rolled, part after the cut
        "live": ledger_sandbox(
            tenant, midnight - timedelta(hours=3), [("provisioning", 0), ("ready", 2)]
        ),
        "morning": ledger_sandbox(
            tenant,
            midnight + timedelta(hours=9),
            [("provisioning", 0), ("deleted", 1800)],
            image="python",
            cpu_millis=1000,
            memory_mib=1024,
        ),
        # open at the cut, closed after it
        "closing": ledger_sandbox(
            tenant, now - timedelta(hours=2), [("provisioning", 0), ("deleted", 2 * 3600 - 20)]
        ),
        "paused": ledger_sandbox(
            tenant, midnight + timedelta(hours=1), [("provisioning", 0), ("ready", 1)]
        ),
    }
    Sandbox.objects.filter(pk=out["morning"].pk).update(created_by="key:abc123")
    assert usage_pause_begin(sandbox_id=out["paused"].pk, at=midnight + timedelta(hours=4))
    assert usage_pause_end(sandbox_id=out["paused"].pk, at=midnight + timedelta(hours=6))
    return out


def _exact(tenant: Any, start: datetime, end: datetime) -> dict[str, Any]:
    """The report, cost per key and peaks, each equal to the record walk's."""
    report = tenant_report(tenant=tenant, start=start, end=end).as_dict()
    assert report == tenant_report_walk(tenant=tenant, start=start, end=end).as_dict()
    assert cost_by_key(tenant=tenant, start=start, end=end) == cost_by_key_walk(
        tenant=tenant, start=start, end=end
    )
    assert peak_concurrency(tenant=tenant, start=start, end=end) == _peak_sweep_walk(
        tenant=tenant, start=start, end=end
    )
    assert report["totals"]["cost"] != "0.00"
    return report


def _cut_of_today(now: datetime) -> datetime | None:
    _, _, partial = _window_days(start=day_bounds(now.date())[0], end=now)
    return partial.get(now.date())


@pytest.mark.django_db
def test_report_reads_today_from_the_partial_rollup_and_the_records_after_its_cut(
    make_tenant,
    book,  # noqa: F811
    clock,
):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    _today(tenant, NOW)
    _today(other, NOW)  # another team's usage never counts
    start = day_bounds(NOW.date() - timedelta(days=2))[0]
    assert _cut_of_today(NOW) is None  # nothing rolled: today from the records
    before = _exact(tenant, start, NOW)
    usage_rollup()  # yesterday (final) and today (partial)
    cut = NOW - LATE_WRITE  # no other transaction in flight
    assert DailyUsageDay.objects.get(day=NOW.date()).computed_at == cut
    assert _cut_of_today(NOW) == cut
    assert _exact(tenant, start, NOW) == before
    # an on-time write after the cut: read from the records, the day stays partial
    clock["now"] = NOW + timedelta(minutes=5)
    ledger_sandbox(tenant, NOW + timedelta(minutes=4), [("provisioning", 0), ("deleted", 40)])
    assert not DailyUsageDay.objects.get(day=NOW.date()).stale
    assert _cut_of_today(clock["now"]) == cut
    after = _exact(tenant, start, clock["now"])
    assert after["totals"]["sandboxes"] == before["totals"]["sandboxes"] + 1
    # a record open at the cut (in the roll-up's sums of open records) paused after it,
    # on time, and one ended after it: each takes back what the sums gave it
    live = Sandbox.objects.get(
        tenant=tenant, created_at=day_bounds(NOW.date())[0] - timedelta(hours=3)
    )
    assert usage_pause_begin(sandbox_id=live.pk, at=clock["now"] - timedelta(seconds=30))
    assert not DailyUsageDay.objects.get(day=NOW.date()).stale
    clock["now"] += timedelta(minutes=2)
    paused = _exact(tenant, start, clock["now"])
    assert paused["totals"]["sandboxes"] == after["totals"]["sandboxes"]


@pytest.mark.django_db
def test_a_late_write_before_and_after_the_partial_rollup_is_counted(
    make_tenant,
    book,  # noqa: F811
    clock,
):
    tenant, _ = make_tenant()
    _today(tenant, NOW)
    start = day_bounds(NOW.date() - timedelta(days=1))[0]
    midnight = day_bounds(NOW.date())[0]

    def late(at: datetime) -> Sandbox:
        """A sandbox whose record the repair sweep writes now, for a time long ago."""
        sandbox: Sandbox = ledger_sandbox(tenant, at, [("provisioning", 0), ("deleted", 3600)])
        UsageRecord.objects.filter(sandbox=sandbox).delete()
        assert usage_record_sync(sandbox_id=sandbox.pk) is not None
        return sandbox

    late(midnight + timedelta(hours=2))  # before the roll-up: it reads it
    usage_rollup()
    assert _cut_of_today(NOW) == NOW - LATE_WRITE
    rolled = _exact(tenant, start, NOW)
    late(midnight + timedelta(hours=3))  # after it, before its cut: today is stale
    marker = DailyUsageDay.objects.get(day=NOW.date())
    assert marker.stale and _cut_of_today(NOW) is None
    after = _exact(tenant, start, NOW)  # today from the records meanwhile
    assert after["totals"]["sandboxes"] == rolled["totals"]["sandboxes"] + 1
    usage_rollup()  # the next round cuts today again
    assert not DailyUsageDay.objects.get(day=NOW.date()).stale
    assert _cut_of_today(NOW) == NOW - LATE_WRITE
    assert _exact(tenant, start, NOW) == after


@pytest.mark.django_db(transaction=True)
def test_a_write_in_flight_while_the_rollup_reads_is_not_lost(
    make_tenant,
    book,  # noqa: F811
    monkeypatch,
):
    """A record written by a transaction that commits after the roll-up's read (so the
    roll-up cannot see it) falls after the roll-up's cut: the cut is ``LATE_WRITE``
    before the oldest writing transaction in flight, not before the roll-up's clock."""
    t0 = datetime.now(UTC).replace(microsecond=0)
    at = {"now": t0}
    monkeypatch.setattr(timezone, "now", lambda: at["now"])
    tenant, _ = make_tenant()
    ledger_sandbox(tenant, t0 - timedelta(hours=1), [("provisioning", 0), ("deleted", 600)])
    written, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with transaction.atomic():
                ledger_sandbox(tenant, t0 - timedelta(seconds=5), [("provisioning", 0)])
                written.set()
                assert release.wait(60)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            written.set()
        finally:
            connection.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert written.wait(60) and not errors
        # the roll-up runs two minutes on: its own clock would cut after the record
        at["now"] = t0 + LATE_WRITE + timedelta(minutes=2)
        cut = rollup_cut(now=at["now"])
        assert cut <= t0 - timedelta(seconds=5) < at["now"] - LATE_WRITE
        daily_usage_rebuild(day=at["now"].date())
    finally:
        release.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    assert UsageRecord.objects.filter(tenant=tenant).count() == 2
    marker = DailyUsageDay.objects.get(day=at["now"].date())
    assert marker.computed_at is not None and marker.computed_at <= t0 - timedelta(seconds=5)
    start = day_bounds(at["now"].date() - timedelta(days=1))[0]
    report = _exact(tenant, start, at["now"])
    assert report["totals"]["sandboxes"] == 2


@pytest.mark.django_db
def test_after_the_cut_a_report_reads_what_changed_not_the_live_records(
    make_tenant,
    book,  # noqa: F811
    clock,
):
    """With today's partial roll-up, the report, cost per key and peaks read the same
    statements and rows whether 20 or 400 records were open (live) at the cut: those
    are summed in the roll-up; only records started or ended since are read."""
    from apps.billing.tests.test_usage_rollup_report import _measured

    tenant, _ = make_tenant()
    _today(tenant, NOW)
    start = day_bounds(NOW.date() - timedelta(days=1))[0]
    book_ = PriceBook.objects.filter(is_reference=False).order_by("-effective_from").first()
    midnight = day_bounds(NOW.date())[0]
    costs = []
    for n in (20, 380):
        sandboxes = Sandbox.objects.bulk_create(
            Sandbox(
                tenant=tenant,
                external_id=f"live-{uuid.uuid4().hex[:12]}",
                state="ready",
                image="host",
                cpu_millis=500,
                memory_mib=256,
                ttl_seconds=86400,
                expires_at=NOW + timedelta(days=1),
                backend="local",
                created_at=midnight + timedelta(hours=2),
                labels={"run": "r1"},
            )
            for _ in range(n)
        )
        UsageRecord.objects.bulk_create(
            UsageRecord(
                sandbox=s,
                tenant=tenant,
                image="host",
                backend="local",
                labels={"run": "r1"},
                cpu_millis=500,
                memory_mib=256,
                started_at=midnight + timedelta(hours=2),
                price_book=book_,
                hourly_rate=Decimal("0.0123456789"),
                startup_fee=Decimal("0.01"),
            )
            for s in sandboxes
        )
        usage_rollup()
        # one on-time change after the cut in each round
        ledger_sandbox(tenant, NOW - timedelta(seconds=30), [("provisioning", 0), ("deleted", 20)])
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE billing_usagerecord, billing_dailyusage, sandboxes_sandbox")
            cursor.execute("SET LOCAL enable_seqscan = off")
        costs.append(
            _measured(
                lambda: (
                    tenant_report(tenant=tenant, start=start, end=NOW),
                    cost_by_key(tenant=tenant, start=start, end=NOW),
                    peak_concurrency(tenant=tenant, start=start, end=NOW),
                )
            )
        )
        _exact(tenant, start, NOW)
    (rows_small, queries_small), (rows_big, queries_big) = costs
    assert queries_small == queries_big, costs
    assert rows_big <= 2 * rows_small and rows_big < 380, costs
