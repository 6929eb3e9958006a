"""Background costs that follow change, not size (issue 20): the rows a periodic round
reads, counted by Postgres itself (``pg_stat_xact_user_tables``: this transaction's
sequential and index tuple reads), at N = 100 and N = 2,000 sandbox rows (DB rows,
not running sandboxes)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from functools import partial
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.billing.models import PriceBook, UsageRecord
from apps.sandboxes.metering import usage
from apps.sandboxes.models import FINAL_STATES, Sandbox, SandboxEvent, State

pytestmark = pytest.mark.django_db

TABLES = ("sandboxes_sandbox", "sandboxes_sandboxevent", "billing_usagerecord")


def _rows_read(tables: tuple[str, ...] = TABLES) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
            [list(tables)],
        )
        return int(cursor.fetchone()[0])


def _cost(fn: Callable[[], Any], tables: tuple[str, ...] = TABLES) -> tuple[int, int, Any]:
    """(rows read, statements, result) of one round, read through the indexes: a table
    of 2,000 rows is small enough that the planner reads all of it rather than probe
    an index 20 times, which it does not at the sizes this is about (10^5-10^6 rows),
    so sequential scans are priced out for the round (``SET LOCAL``: this test's
    transaction only). A round that must read everything still does, through an index."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
    before = _rows_read(tables)
    with CaptureQueriesContext(connection) as queries:
        result = fn()
    return _rows_read(tables) - before, len(queries), result


def _add(tenant: Any, n: int, *, state: str, moved_ago: timedelta) -> list[Sandbox]:
    """``n`` sandbox rows that held resources, with their ledger's first move and last
    transition ``moved_ago`` and a usage record (closed when ended)."""
    at = timezone.now() - moved_ago
    book = PriceBook.objects.filter(is_reference=False).order_by("-effective_from").first()
    ended = state in FINAL_STATES
    rows = Sandbox.objects.bulk_create(
        Sandbox(
            tenant=tenant,
            external_id=f"x-{uuid.uuid4().hex[:12]}",
            state=state,
            generation=1,
            image="host",
            cpu_millis=1000,
            memory_mib=512,
            ttl_seconds=86400,
            expires_at=timezone.now() + timedelta(days=1),
            backend="local",
            created_at=at,
            provisioning_started_at=at,
            ready_at=at,
            terminated_at=at if ended else None,
        )
        for _ in range(n)
    )
    events = []
    for s in rows:
        events.append(
            SandboxEvent(sandbox=s, tenant=tenant, at=at, event="created", to_state=State.REQUESTED)
        )
        for frm, to in (("requested", "provisioning"), ("provisioning", "ready")):
            events.append(
                SandboxEvent(
                    sandbox=s, tenant=tenant, at=at, event="transition", from_state=frm, to_state=to
                )
            )
        if ended:
            events.append(
                SandboxEvent(
                    sandbox=s,
                    tenant=tenant,
                    at=at,
                    event="transition",
                    from_state="ready",
                    to_state=state,
                    reason="destroyed",
                )
            )
    SandboxEvent.objects.bulk_create(events)
    UsageRecord.objects.bulk_create(
        UsageRecord(
            sandbox=s,
            tenant=tenant,
            image="host",
            backend="local",
            cpu_millis=1000,
            memory_mib=512,
            started_at=at,
            ended_at=at if ended else None,
            end_state=state if ended else "",
            price_book=book,
            hourly_rate=Decimal("0.045"),
            startup_fee=Decimal("0.0005"),
        )
        for s in rows
    )
    return rows


def _analyze(tables: tuple[str, ...] = TABLES) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {', '.join(tables)}")


def test_the_minutely_usage_sweep_reads_what_moved_not_what_exists(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    # The same recent change in both rounds: 20 sandboxes that just moved, one of which
    # lost its record, one whose record was left open after it ended.
    recent = _add(tenant, 10, state=State.READY, moved_ago=timedelta(minutes=1))
    recent += _add(tenant, 10, state=State.DELETED, moved_ago=timedelta(minutes=1))
    lost_record, left_open = recent[0], recent[-1]

    def breakage() -> None:
        UsageRecord.objects.filter(sandbox=lost_record).delete()
        UsageRecord.objects.filter(sandbox=left_open).update(ended_at=None, end_state="")

    measured: dict[int, dict[str, int]] = {}
    for n in (100, 2000):
        have = Sandbox.objects.filter(tenant=tenant).count() - len(recent)
        grow = n - have
        # half idle live sandboxes (ready for hours), half history (ended days ago)
        _add(tenant, grow // 2, state=State.READY, moved_ago=timedelta(hours=3))
        _add(tenant, grow - grow // 2, state=State.DELETED, moved_ago=timedelta(days=3))
        _analyze()
        breakage()
        rows, statements, synced = _cost(lambda: usage.usage_sweep())
        assert synced == 2  # both repaired, whatever N
        assert UsageRecord.objects.filter(sandbox=lost_record, ended_at=None).exists()
        assert UsageRecord.objects.get(sandbox=left_open).end_state == State.DELETED
        breakage()
        full_rows, _, full_synced = _cost(lambda: usage.usage_sweep(full=True))
        assert full_synced == 2
        measured[n] = {"rows": rows, "statements": statements, "full_rows": full_rows}

    small, large = measured[100], measured[2000]
    # what the minutely round reads follows the 20 that moved: within 2x (here: equal
    # up to index page noise), and the statements are the same
    assert large["rows"] <= 2 * small["rows"], measured
    assert large["statements"] == small["statements"], measured
    # the daily backstop reads every sandbox: it is the one that grows with N
    assert large["full_rows"] >= 10 * small["full_rows"] and large["full_rows"] >= 2000, measured


def test_retention_reads_what_is_due_not_the_history(make_tenant: Any) -> None:
    from apps.sandboxes.services.retention import retention_apply

    tenant, _ = make_tenant()
    measured: dict[int, int] = {}
    for n in (100, 2000):
        have = Sandbox.objects.filter(tenant=tenant).count()
        # ended and already summarized (retention's earlier runs), plus idle live ones
        done = _add(tenant, (n - have) // 2, state=State.DELETED, moved_ago=timedelta(days=200))
        Sandbox.objects.filter(pk__in=[s.pk for s in done]).update(retention=2)
        _add(tenant, (n - have) - (n - have) // 2, state=State.READY, moved_ago=timedelta(days=1))
        # the same 5 newly due in both rounds
        due = _add(tenant, 5, state=State.DELETED, moved_ago=timedelta(days=100))
        Sandbox.objects.filter(pk__in=[s.pk for s in due]).update(
            updated_at=timezone.now() - timedelta(days=100)
        )
        _analyze()
        rows, _, result = _cost(lambda: retention_apply())
        assert result.sandboxes_summarized == 5
        measured[n] = rows
    assert measured[2000] <= 2 * measured[100], measured


def test_the_daily_roll_up_reads_the_days_records_not_the_history(make_tenant: Any) -> None:
    from apps.billing.reports import daily_usage_rebuild

    tenant, _ = make_tenant()
    today = timezone.now().date()
    _add(tenant, 10, state=State.READY, moved_ago=timedelta(hours=3))  # open: they overlap
    _add(tenant, 10, state=State.DELETED, moved_ago=timedelta(minutes=5))
    measured: dict[int, int] = {}
    for n in (100, 2000):
        have = Sandbox.objects.filter(tenant=tenant).count() - 20
        # history: records that ended days ago and overlap neither yesterday nor today
        _add(tenant, n - have, state=State.DELETED, moved_ago=timedelta(days=5))
        _analyze()
        rows, _, written = _cost(lambda: daily_usage_rebuild(day=today))
        # total, image, price book, key, peak, and the same five of the records open at
        # today's cut (its partial roll-up's sums): whatever the history
        assert written == 10
        measured[n] = rows
    assert measured[2000] <= 2 * measured[100], measured


def test_the_heartbeat_reaper_reads_what_is_due_not_every_live_sandbox(
    make_tenant: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.sandboxes.services import provisioning

    destroyed: list[str] = []
    monkeypatch.setattr("apps.sandboxes.tasks.destroy_sandbox.delay", destroyed.append)
    tenant, _ = make_tenant()
    measured: dict[int, dict[str, int]] = {}
    for n in (100, 2000):
        now = timezone.now()
        have = Sandbox.objects.filter(tenant=tenant, state=State.READY).count()
        # idle live sandboxes whose clients beat: the last heartbeat set the due time
        # a timeout ahead (as sandbox_heartbeat does)
        live = _add(tenant, n - have, state=State.READY, moved_ago=timedelta(hours=3))
        Sandbox.objects.filter(pk__in=[s.pk for s in live]).update(
            heartbeat_timeout_s=300,
            last_heartbeat_at=now - timedelta(seconds=10),
            heartbeat_due_at=now + timedelta(seconds=290),
        )
        # the same 5 gone silent in both rounds, their due time passed
        silent = _add(tenant, 5, state=State.READY, moved_ago=timedelta(hours=3))
        Sandbox.objects.filter(pk__in=[s.pk for s in silent]).update(
            heartbeat_timeout_s=300,
            last_heartbeat_at=now - timedelta(seconds=400),
            heartbeat_due_at=now - timedelta(seconds=100),
        )
        _analyze()
        rows, statements, counts = _cost(partial(provisioning.sandbox_reap, now=now))
        assert counts["heartbeat_expired"] == 5, counts
        assert set(destroyed[-5:]) == {str(s.id) for s in silent}
        assert Sandbox.objects.filter(tenant=tenant, state=State.READY).count() == n
        measured[n] = {"rows": rows, "statements": statements}
    # 5 expired rows read (and moved) per round whatever N: within 2x, same statements
    assert measured[2000]["rows"] <= 2 * measured[100]["rows"], measured
    assert measured[2000]["statements"] == measured[100]["statements"], measured


def test_the_metrics_action_counter_reads_what_happened_since_the_fold(make_tenant: Any) -> None:
    """``hedgerow_lifecycle_actions_total`` is a count over the whole ledger; the scrape
    reads the rows since its fold (services/metrics_fold.py), not the history."""
    from apps.sandboxes.metrics import AUTOMATIC_ACTORS, HedgerowCollector
    from apps.sandboxes.models import MetricsFold

    tenant, _ = make_tenant()
    (recent,) = _add(tenant, 1, state=State.READY, moved_ago=timedelta(minutes=1))

    def scrape() -> dict[tuple[str, ...], float]:
        (family,) = list(HedgerowCollector()._actions())
        return {tuple(s.labels.values()): s.value for s in family.samples}

    measured: dict[int, int] = {}
    for n in (100, 2000):
        have = Sandbox.objects.filter(tenant=tenant).count()
        # history: sandboxes the reaper ended days ago (an automatic action each)
        ended = _add(tenant, n - have, state=State.DELETED, moved_ago=timedelta(days=3))
        SandboxEvent.objects.filter(sandbox__in=ended, to_state=State.DELETED).update(
            actor="reaper", reason="ttl_expired"
        )
        _analyze()
        # a first scrape folds the history once (as after an upgrade)
        MetricsFold.objects.filter(name="lifecycle_actions").delete()
        folded = scrape()
        assert folded[("reaper", "transition", "ttl_expired")] == n - 1
        # since then: the same 5 automatic actions in both rounds
        for _ in range(5):
            SandboxEvent.objects.create(
                sandbox=recent, tenant=tenant, event="heartbeat_late", reason="late", actor="reaper"
            )
        rows, statements, counts = _cost(scrape)
        assert counts[("reaper", "heartbeat_late", "late")] == 5 * (1 + (n == 2000))
        assert sum(counts.values()) == (
            SandboxEvent.objects.filter(actor__in=AUTOMATIC_ACTORS).exclude(reason="").count()
        )
        measured[n] = rows
    # the history is 20x larger; the scrape reads the rows since the fold either way
    assert measured[2000] <= 2 * measured[100], measured


SNAPSHOT_TABLES = ("sandboxes_snapshot", "billing_storagerecord")


def _snapshots(sandbox: Sandbox, n: int, *, ago: timedelta, deleted: bool) -> list[Any]:
    """``n`` snapshots captured ``ago`` with their storage records (closed when deleted
    at the same time), as the capture and delete services leave them."""
    from apps.billing.models import StorageRecord
    from apps.sandboxes.models import Snapshot

    at = timezone.now() - ago
    book = PriceBook.objects.filter(is_reference=False).order_by("-effective_from").first()
    snaps = Snapshot.objects.bulk_create(
        Snapshot(
            tenant_id=sandbox.tenant_id,
            sandbox=sandbox,
            state="deleted" if deleted else "ready",
            backend="local",
            image="host",
            size_bytes=1 << 20,
            ttl_seconds=86400,
            expires_at=at + timedelta(days=1),
            created_at=at,
            captured_at=at,
            deleted_at=at if deleted else None,
        )
        for _ in range(n)
    )
    StorageRecord.objects.bulk_create(
        StorageRecord(
            snapshot=s,
            tenant_id=sandbox.tenant_id,
            sandbox_id=sandbox.pk,
            kind="snapshot",
            size_bytes=1 << 20,
            started_at=at,
            ended_at=at if deleted else None,
            price_book=book,
            gib_hour=Decimal("0.001"),
        )
        for s in snaps
    )
    return snaps


def test_the_minutely_storage_sweep_reads_what_changed_not_every_snapshot(
    make_tenant: Any,
) -> None:
    from apps.billing.models import StorageRecord
    from apps.sandboxes.metering.storage import storage_sweep
    from apps.sandboxes.models import Snapshot

    tenant, _ = make_tenant()
    (sandbox,) = _add(tenant, 1, state=State.READY, moved_ago=timedelta(hours=3))
    measured: dict[int, dict[str, int]] = {}
    for n in (100, 2000):
        have = Snapshot.objects.filter(tenant=tenant).count()
        # history: half deleted days ago (records closed), half kept (records open)
        _snapshots(sandbox, (n - have) // 2, ago=timedelta(days=3), deleted=True)
        _snapshots(sandbox, (n - have) - (n - have) // 2, ago=timedelta(days=3), deleted=False)
        # the same change in both rounds: one capture whose record a crash lost, one
        # deletion whose record a crash left open
        (lost,) = _snapshots(sandbox, 1, ago=timedelta(minutes=1), deleted=False)
        StorageRecord.objects.filter(snapshot=lost).delete()
        (unclosed,) = _snapshots(sandbox, 1, ago=timedelta(days=1), deleted=False)
        Snapshot.objects.filter(pk=unclosed.pk).update(
            state="deleted", deleted_at=timezone.now() - timedelta(minutes=1)
        )
        _analyze(SNAPSHOT_TABLES)
        rows, statements, synced = _cost(storage_sweep, SNAPSHOT_TABLES)
        assert synced == 2  # both repaired, whatever N
        assert StorageRecord.objects.get(snapshot=lost).ended_at is None
        assert StorageRecord.objects.get(snapshot=unclosed).ended_at is not None
        full_rows, _, full_synced = _cost(partial(storage_sweep, full=True), SNAPSHOT_TABLES)
        assert full_synced == 0  # nothing left to repair
        measured[n] = {"rows": rows, "statements": statements, "full_rows": full_rows}
    small, large = measured[100], measured[2000]
    assert large["rows"] <= 2 * small["rows"], measured
    assert large["statements"] == small["statements"], measured
    # the daily backstop reads every snapshot: the one that grows with N
    assert large["full_rows"] >= 10 * small["full_rows"] and large["full_rows"] >= 2000, measured


METRIC_TABLES = (
    "sandboxes_sandbox",
    "sandboxes_sandboxevent",
    "sandboxes_operation",
    "sandboxes_operationsummary",
    "sandboxes_metricsdelta",
    "sandboxes_metricsfold",
    "sandboxes_reconcilerun",
)


def _finished_ops(sandboxes: list[Sandbox], *, ago: timedelta) -> None:
    """One finished operation per sandbox (every tenth failed), as execs leave them."""
    from apps.sandboxes.models import Operation

    at = timezone.now() - ago
    Operation.objects.bulk_create(
        Operation(
            tenant_id=s.tenant_id,
            sandbox=s,
            operation_id=f"op-{uuid.uuid4().hex[:12]}",
            generation=1,
            request={"command": ["true"]},
            request_hash="h",
            status="failed" if i % 10 == 0 else "completed",
            error={"code": "agent_unreachable", "message": "x"} if i % 10 == 0 else None,
            created_at=at,
            finished_at=at + timedelta(milliseconds=5 * (i % 7)),
        )
        for i, s in enumerate(sandboxes)
    )


def test_a_metrics_scrape_reads_what_changed_not_every_sandbox_and_operation(
    make_tenant: Any,
) -> None:
    """The whole scrape: the sandbox gauge, both histograms and the error counter are
    tallied on write (services/metrics_tally.py), the ledger and reconciler counters
    folded; what a scrape reads follows what changed since the last one."""
    from apps.sandboxes.metrics import HedgerowCollector
    from apps.sandboxes.tests.test_metrics_tally import assert_exact, recount

    tenant, _ = make_tenant()

    def scrape() -> list[Any]:
        return list(HedgerowCollector().collect())

    measured: dict[int, dict[str, int]] = {}
    for n in (100, 2000):
        have = Sandbox.objects.filter(tenant=tenant).count()
        # half idle live sandboxes, half history; an operation each
        grow = n - have
        live = _add(tenant, grow // 2, state=State.READY, moved_ago=timedelta(hours=3))
        gone = _add(tenant, grow - grow // 2, state=State.DELETED, moved_ago=timedelta(days=3))
        _finished_ops(live + gone, ago=timedelta(hours=2))
        _analyze(METRIC_TABLES)
        scrape()  # the growth is folded (as the minutely fold-metrics task does)
        scrape()  # ...and the ledger counters' folds moved up past it
        # the same change in both rounds: 5 sandboxes created and ready, 5 execs
        recent = _add(tenant, 5, state=State.READY, moved_ago=timedelta(minutes=1))
        _finished_ops(recent, ago=timedelta(seconds=30))
        rows, statements, _ = _cost(scrape, METRIC_TABLES)
        full_rows, _, _ = _cost(recount, METRIC_TABLES)  # what the scrape read before
        assert_exact()
        measured[n] = {"rows": rows, "statements": statements, "full_rows": full_rows}
    small, large = measured[100], measured[2000]
    # within 2x; what grows is the ledger rows of the last 5 minutes (the folds' lag),
    # 5 sandboxes' more in the second round
    assert large["rows"] <= 2 * small["rows"], measured
    assert large["statements"] == small["statements"], measured
    # the recount it replaced reads every sandbox and operation
    assert large["full_rows"] >= 10 * small["full_rows"] and large["full_rows"] >= 4000, measured
