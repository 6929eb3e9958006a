"""The usage report reads finished days from the daily roll-up and only the rest from the
records (issue 20): the same figures as walking every record, a late write to a rolled
day is seen, and the rows it reads do not grow with the history."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from apps.billing.models import DailyUsageDay, PriceBook, UsageRecord
from apps.billing.reports import (
    _SANDBOX_TABLE,
    _TOTALS_SQL,
    _peak_sweep,
    _peak_sweep_walk,
    cost_by_key,
    cost_by_key_walk,
    daily_usage_rebuild,
    day_bounds,
    peak_concurrency,
    tenant_report,
    tenant_report_walk,
    window_usage,
)
from apps.billing.tasks import usage_rollup
from apps.billing.tests.test_costs import book, ledger_sandbox  # noqa: F401 (fixture)
from apps.billing.usage import usage_pause_begin, usage_pause_end
from apps.sandboxes.metering.usage import usage_record_sync
from apps.sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> datetime:
    """One ``now`` for the report and its reference (live records accrue to it)."""
    now = timezone.now().replace(microsecond=0)
    monkeypatch.setattr(timezone, "now", lambda: now)
    return now


def _history(tenant: Any, now: datetime) -> dict[str, Sandbox]:
    d = {k: day_bounds((now - timedelta(days=k)).date())[0] for k in (1, 2, 3)}
    out = {
        # across a midnight, two labels, created by an API key
        "night": ledger_sandbox(
            tenant,
            d[3] + timedelta(hours=22),
            [("provisioning", 0), ("deleted", 4 * 3600)],
            labels={"exp": "rl-1", "run": "7"},
        ),
        # live since two days ago: accrues to now
        "live": ledger_sandbox(
            tenant, d[2] + timedelta(hours=10, seconds=17), [("provisioning", 0), ("ready", 3)]
        ),
        "python": ledger_sandbox(
            tenant,
            d[1] + timedelta(hours=5),
            [("provisioning", 0), ("deleted", 5400)],
            image="python",
            cpu_millis=1000,
            memory_mib=1024,
        ),
        "recent": ledger_sandbox(
            tenant, now - timedelta(seconds=90), [("provisioning", 0), ("deleted", 60)]
        ),
        "paused": ledger_sandbox(
            tenant, d[2] + timedelta(hours=8), [("provisioning", 0), ("ready", 1)]
        ),
    }
    Sandbox.objects.filter(pk=out["night"].pk).update(created_by="key:abc123")
    Sandbox.objects.filter(pk=out["python"].pk).update(created_by="key:def456")
    assert usage_pause_begin(sandbox_id=out["paused"].pk, at=d[2] + timedelta(hours=12))
    assert usage_pause_end(sandbox_id=out["paused"].pk, at=d[2] + timedelta(hours=14))
    return out


def _same(window: dict[str, Any], walk: dict[str, Any]) -> None:
    assert window == walk
    assert window["totals"]["sandboxes"] > 0 and window["totals"]["cost"] != "0.00"


def test_report_from_rollup_and_today_equals_the_record_walk(make_tenant, book, frozen):  # noqa: F811
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    _history(tenant, frozen)
    _history(other, frozen)  # another team's usage never counts
    start = day_bounds((frozen - timedelta(days=3)).date())[0]
    for k in (1, 2, 3):
        daily_usage_rebuild(day=(frozen - timedelta(days=k)).date())
    assert DailyUsageDay.objects.filter(stale=False, computed_at__gte=start).count() == 3
    report = tenant_report(tenant=tenant, start=start, end=frozen).as_dict()
    _same(report, tenant_report_walk(tenant=tenant, start=start, end=frozen).as_dict())
    assert [d["day"] for d in report["days"]] == [
        (frozen - timedelta(days=k)).date().isoformat() for k in (3, 2, 1, 0)
    ]
    assert report["totals"]["sandboxes"] == 5
    peaks = peak_concurrency(tenant=tenant, start=start, end=frozen)
    assert peaks == _peak_sweep(tenant=tenant, start=start, end=frozen)
    assert peaks == _peak_sweep_walk(tenant=tenant, start=start, end=frozen)
    assert max(d["peak"] for d in peaks) >= 2  # the live one and the paused one overlap
    assert cost_by_key(tenant=tenant, start=start, end=frozen) == cost_by_key_walk(
        tenant=tenant, start=start, end=frozen
    )
    assert {r["key"] for r in cost_by_key(tenant=tenant, start=start, end=frozen)} == {
        "abc123",
        "def456",
        "",
    }
    # a window with partial days at both ends, and one without any roll-up
    mid = start + timedelta(hours=23, minutes=30)
    end = frozen - timedelta(days=1, hours=1)
    _same(
        tenant_report(tenant=tenant, start=mid, end=end).as_dict(),
        tenant_report_walk(tenant=tenant, start=mid, end=end).as_dict(),
    )
    assert peak_concurrency(tenant=tenant, start=mid, end=end) == _peak_sweep(
        tenant=tenant, start=mid, end=end
    )
    DailyUsageDay.objects.all().delete()
    _same(
        tenant_report(tenant=tenant, start=start, end=frozen).as_dict(),
        tenant_report_walk(tenant=tenant, start=start, end=frozen).as_dict(),
    )


def test_a_late_record_on_a_rolled_day_is_counted_and_rolled_again(make_tenant, book, frozen):  # noqa: F811
    tenant, _ = make_tenant()
    _history(tenant, frozen)
    start = day_bounds((frozen - timedelta(days=3)).date())[0]
    for k in (1, 2, 3):
        daily_usage_rebuild(day=(frozen - timedelta(days=k)).date())
    before = tenant_report(tenant=tenant, start=start, end=frozen).as_dict()
    # The hook missed a sandbox that ran two days ago; the repair sweep writes its
    # record now, after those days were rolled up.
    late_at = day_bounds((frozen - timedelta(days=2)).date())[0] + timedelta(hours=3)
    late = ledger_sandbox(tenant, late_at, [("provisioning", 0), ("deleted", 7200)])
    UsageRecord.objects.filter(sandbox=late).delete()
    DailyUsageDay.objects.update(stale=False)  # as the roll-up left them
    assert usage_record_sync(sandbox_id=late.pk) is not None
    assert set(DailyUsageDay.objects.filter(stale=True).values_list("day", flat=True)) == {
        (frozen - timedelta(days=k)).date() for k in (1, 2)
    }
    after = tenant_report(tenant=tenant, start=start, end=frozen).as_dict()
    _same(after, tenant_report_walk(tenant=tenant, start=start, end=frozen).as_dict())
    assert after["totals"]["sandboxes"] == before["totals"]["sandboxes"] + 1
    # the periodic task rebuilds the stale days; they are final again, same figures
    usage_rollup()
    assert not DailyUsageDay.objects.filter(stale=True).exists()
    assert tenant_report(tenant=tenant, start=start, end=frozen).as_dict() == after


def test_a_late_write_during_a_rebuild_leaves_the_day_stale(
    make_tenant,
    book,  # noqa: F811
    frozen,
    monkeypatch,
):
    tenant, _ = make_tenant()
    _history(tenant, frozen)
    day = (frozen - timedelta(days=2)).date()
    daily_usage_rebuild(day=day)
    marker = DailyUsageDay.objects.get(day=day)
    assert not marker.stale
    # a bump between the rebuild's read of the version and its commit
    from apps.billing import reports

    real = reports.records_overlapping  # type: ignore[attr-defined]

    def bumped(**kw: Any) -> Any:
        DailyUsageDay.objects.filter(day=day).update(stale=True, version=marker.version + 1)
        return real(**kw)

    monkeypatch.setattr(reports, "records_overlapping", bumped)
    daily_usage_rebuild(day=day)
    assert DailyUsageDay.objects.get(day=day).stale


def _rows_read() -> int:
    # the driver's own cursor: not through Django's wrappers (the measuring one below)
    with connection.connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
            [["billing_usagerecord", "billing_dailyusage", "sandboxes_sandbox"]],
        )
        row = cursor.fetchone()
        assert row is not None
        return int(row[0])


def _measured(fn: Any) -> tuple[int, int]:
    """(rows Postgres read, statements) of ``fn``: each statement's reads counted around
    it (``pg_stat_xact_user_tables``), so reads of earlier work that land late do not."""
    rows = [0, 0]

    def wrap(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        before = _rows_read()
        try:
            return execute(sql, params, many, context)
        finally:
            rows[0] += _rows_read() - before
            rows[1] += 1

    with connection.execute_wrapper(wrap):
        fn()
    return rows[0], rows[1]


def _closed(tenant: Any, n: int, at: datetime) -> None:
    """``n`` ended sandboxes with closed usage records, all in the hour after ``at``."""
    book_ = PriceBook.objects.filter(is_reference=False).order_by("-effective_from").first()
    rows = Sandbox.objects.bulk_create(
        Sandbox(
            tenant=tenant,
            external_id=f"h-{uuid.uuid4().hex[:12]}",
            state="deleted",
            image="host",
            cpu_millis=1000,
            memory_mib=512,
            ttl_seconds=3600,
            expires_at=at + timedelta(hours=1),
            backend="local",
            created_at=at,
            created_by="key:abc123",
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
            cpu_millis=1000,
            memory_mib=512,
            started_at=at,
            ended_at=at + timedelta(minutes=30),
            price_book=book_,
            hourly_rate=Decimal("0.123456"),
            startup_fee=0,
        )
        for s in rows
    )


def test_report_reads_the_same_rows_at_100_and_2000_records_of_history(
    make_tenant,
    book,  # noqa: F811
    frozen,
):
    tenant, _ = make_tenant()
    _history(tenant, frozen)
    start = day_bounds((frozen - timedelta(days=30)).date())[0]
    costs = []
    for n in (100, 1900):
        _closed(tenant, n, day_bounds((frozen - timedelta(days=5)).date())[0])
        for k in range(1, 31):
            daily_usage_rebuild(day=(frozen - timedelta(days=k)).date())
        with connection.cursor() as cursor:
            # the planner's statistics, as autovacuum keeps them; sequential scans priced
            # out (a table this small is cheaper to read whole than through an index,
            # which it is not at the sizes this is about: test_background_costs.py)
            cursor.execute("ANALYZE billing_usagerecord, billing_dailyusage, sandboxes_sandbox")
            cursor.execute("SET LOCAL enable_seqscan = off")
        costs.append(
            _measured(
                lambda: (
                    tenant_report(tenant=tenant, start=start, end=frozen),
                    cost_by_key(tenant=tenant, start=start, end=frozen),
                    peak_concurrency(tenant=tenant, start=start, end=frozen),
                )
            )
        )
        report = tenant_report(tenant=tenant, start=start, end=frozen).as_dict()
        assert report == tenant_report_walk(tenant=tenant, start=start, end=frozen).as_dict()
    (rows_small, queries_small), (rows_big, queries_big) = costs
    assert queries_small == queries_big
    # within 2x (the planner's choices at 100 rows differ), and far below the 2,000
    # records of history a read of the records would touch
    assert rows_big <= 2 * rows_small and rows_big < 500, costs


@pytest.mark.parametrize("path", ["/billing/usage/", "/api/v1/usage", "/sandboxes/"])
def test_usage_pages_read_the_same_at_100_and_2000_records_of_history(
    make_tenant,
    api_client,
    book,  # noqa: F811
    frozen,
    path,
):
    """The usage page and API (report, cost per key, peak concurrency, quota bars) and the
    sandbox list (whose quota bars show the month to date): same statements, rows read
    within 2x, at 100 and 2,000 records of rolled-up history."""
    from django.contrib.auth.models import User
    from django.test import Client

    from apps.tenancy.services import membership_set_role

    tenant, secret = make_tenant()
    _history(tenant, frozen)
    user = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="pw")
    membership_set_role(tenant=tenant, user=user, role="owner")
    client: Any = api_client(secret) if path.startswith("/api/") else Client()
    if not path.startswith("/api/"):
        client.force_login(user)
    assert client.get(path).status_code == 200  # warm: sessions, caches
    costs = []
    for n in (100, 1900):
        # history this month when the month is old enough, else last month's
        _closed(tenant, n, day_bounds((frozen - timedelta(days=3)).date())[0])
        for k in range(1, 35):
            daily_usage_rebuild(day=(frozen - timedelta(days=k)).date())
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE billing_usagerecord, billing_dailyusage, sandboxes_sandbox")
            cursor.execute("SET LOCAL enable_seqscan = off")
        responses: list[Any] = []
        costs.append(_measured(lambda got=responses: got.append(client.get(path))))
        assert [r.status_code for r in responses] == [200]
    (rows_small, queries_small), (rows_big, queries_big) = costs
    assert queries_small == queries_big, costs
    assert rows_big <= 2 * rows_small and rows_big < 1000, costs


def test_totals_only_window_equals_the_sliced_one_without_reading_sandboxes(
    make_tenant,
    book,  # noqa: F811
    frozen,
):
    """The quota bars' month to date (``slices=False``): the same totals and days as the
    full read, no slices, and a statement that reads no sandbox row (its creator is a
    slice) — today, a stale day and the paused records included."""
    assert _SANDBOX_TABLE not in _TOTALS_SQL and "labels" not in _TOTALS_SQL
    tenant, _ = make_tenant()
    _history(tenant, frozen)
    daily_usage_rebuild(day=(frozen - timedelta(days=2)).date())  # one day rolled, others not
    start = day_bounds((frozen - timedelta(days=3)).date())[0]
    full = window_usage(tenant=tenant, start=start, end=frozen)
    light = window_usage(tenant=tenant, start=start, end=frozen, slices=False)
    assert light.per_slice == {} and full.per_slice
    assert light.totals.sandboxes == full.totals.sandboxes == 5
    assert light.totals.sandbox_seconds == full.totals.sandbox_seconds
    assert abs(light.totals.cost - full.totals.cost) < Decimal("1e-10")
    assert light.books == full.books
    assert sorted(light.per_day) == sorted(full.per_day)
    for day, t in full.per_day.items():
        assert light.per_day[day].sandbox_seconds == t.sandbox_seconds


def test_the_usage_page_reads_the_window_once_and_equals_the_walk(
    make_tenant,
    book,  # noqa: F811
    frozen,
):
    """The page's report, cost per key, month to date and quota bars share one read of
    the window (one statement over today's records, no second one for the month, one
    peak sweep in SQL), and what it shows is the record walk's: the report (with the
    month to date taken from the window's days), cost per key and peak concurrency."""
    from django.contrib.auth.models import User
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from apps.tenancy.services import membership_set_role

    tenant, _ = make_tenant()
    _history(tenant, frozen)
    for k in range(1, 32):
        daily_usage_rebuild(day=(frozen - timedelta(days=k)).date())
    user = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="pw")
    membership_set_role(tenant=tenant, user=user, role="owner")
    client = Client()
    client.force_login(user)
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/billing/usage/")
    assert response.status_code == 200
    sqls = [q["sql"] for q in queries.captured_queries]
    assert sum("WITH ORDINALITY" in s for s in sqls) == 1, sqls  # today's part, once
    assert sum("FROM held" in s for s in sqls) == 1  # the peak sweep
    start = day_bounds((frozen - timedelta(days=30)).date())[0]
    walk = tenant_report_walk(tenant=tenant, start=start, end=frozen).as_dict()
    assert response.context["report"] == walk
    assert walk["month_to_date"]["cost"] != "0.00"
    assert response.context["by_key"] == cost_by_key_walk(tenant=tenant, start=start, end=frozen)
    assert response.context["concurrency"] == _peak_sweep_walk(
        tenant=tenant, start=start, end=frozen
    )
