"""The list page's numbers at size (issue 20): kept as episodes change (a trigger's
deltas, folded), final costs stored once; equal to a recount of the rows after every
kind of change, and a page view that reads the same at two sizes of history."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.billing.models import PriceBook, UsageRecord
from apps.sandboxes.models import Sandbox, State
from apps.trajectories import selectors
from apps.trajectories.cost import QUANTUM, episode_sandbox_cost, episodes_total_cost
from apps.trajectories.models import INVALID_CLASSES, Episode, EpisodeTallyDelta, FailureClass
from apps.trajectories.services.episodes import (
    EpisodeResult,
    episode_close,
    episode_open,
    episode_relabel,
)
from apps.trajectories.services.lineage import withdraw
from apps.trajectories.services.tally import episode_tally_fold, episodes_settle_costs

pytestmark = pytest.mark.django_db


def _sandbox(tenant: Any, *, started_ago: timedelta) -> Sandbox:
    """A ready sandbox row that holds resources, with its open usage record."""
    at = timezone.now() - started_ago
    sandbox = Sandbox.objects.create(
        tenant=tenant,
        external_id=f"x-{uuid.uuid4().hex[:12]}",
        state=State.READY,
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
    )
    book = PriceBook.objects.filter(is_reference=False).order_by("-effective_from").first()
    assert book is not None
    UsageRecord.objects.create(
        sandbox=sandbox,
        tenant=tenant,
        image="host",
        backend="local",
        cpu_millis=1000,
        memory_mib=512,
        started_at=at,
        price_book=book,
        hourly_rate=Decimal("0.36"),
        startup_fee=Decimal("0.0005"),
    )
    return sandbox


def _end(sandbox: Sandbox, *, close_usage: bool = True) -> None:
    now = timezone.now()
    Sandbox.objects.filter(pk=sandbox.pk).update(state=State.DELETED, terminated_at=now)
    if close_usage:
        UsageRecord.objects.filter(sandbox=sandbox).update(ended_at=now, end_state="deleted")


def _open(tenant: Any, task: str, sandboxes: list[Sandbox] | None = None, **fields: Any) -> Episode:
    episode, _ = episode_open(
        tenant=tenant,
        actor="t",
        fields={"task_id": task, **fields},
        sandbox_ids=[s.external_id for s in sandboxes or []],
    )
    return episode


def _close(episode: Episode, *, reward: float, client_cost: str = "0") -> Episode:
    return episode_close(
        episode=Episode.objects.get(pk=episode.pk),
        result=EpisodeResult(
            termination_reason="submitted",
            reward=reward,
            verifier_outcome="pass" if reward > 0 else "fail",
            client_cost=Decimal(client_cost),
        ),
    )


def _recount(tenant: Any, **only: str) -> dict[str, Any]:
    """The numbers from the episode rows themselves, one by one: classes and tasks
    counted in Python; a final cost re-derived from its sandboxes and required to equal
    what is stored, any other computed now."""
    rows = list(Episode.objects.for_tenant(tenant).filter(**only))
    closed = [e for e in rows if e.status == "closed"]
    by_class = Counter(e.failure_class or FailureClass.UNDETERMINED for e in closed)
    per_task: dict[str, list[int]] = {}
    for e in closed:
        t = per_task.setdefault(e.task_id, [0, 0, 0])
        t[0] += 1
        t[1] += e.failure_class not in INVALID_CLASSES
        t[2] += e.failure_class == FailureClass.SUCCESS
    cost = Decimal(0)
    for e in closed:
        if e.cost_final:
            linked = e.sandbox_links.filter(sandbox__isnull=False).exists()
            if linked:
                share, _ = episode_sandbox_cost(episode=e)
                assert e.cost == share + e.client_cost, e.episode_id
            cost += e.cost
    cost += episodes_total_cost(
        episodes=Episode.objects.filter(pk__in=[e.pk for e in closed if not e.cost_final])
    )
    return {
        "episodes": len(closed),
        "open": sum(e.status == "open" for e in rows),
        "by_class": {c: by_class.get(c, 0) for c in FailureClass.values},
        "per_task": {k: tuple(v) for k, v in sorted(per_task.items())},
        "cost": cost.quantize(QUANTUM),
    }


def _kept(tenant: Any, **filters: str) -> dict[str, Any]:
    stats, as_stored = selectors.episode_stats_kept(tenant=tenant, filters=filters)
    assert as_stored == 0
    return {
        "episodes": stats.episodes,
        "open": stats.open_episodes,
        "by_class": stats.by_class,
        "per_task": {t.task_id: (t.rollouts, t.valid, t.successes) for t in stats.per_task},
        "cost": stats.cost,
    }


def _between(tenant: Any, **filters: str) -> dict[str, Any]:
    """The kept numbers, checked against a recount just before and just after: a live
    sandbox's cost accrues while they are read, so the kept cost lies between the two
    (equal to both when nothing is live); everything else equals the recount."""
    only = {selectors.TALLY_FILTERS[k]: v for k, v in filters.items()}
    before = _recount(tenant, **only)
    kept = _kept(tenant, **filters)
    after = _recount(tenant, **only)
    assert before["cost"] <= kept["cost"] <= after["cost"]
    assert {**kept, "cost": None} == {**before, "cost": None} == {**after, "cost": None}
    return kept


def _agree(tenant: Any) -> dict[str, Any]:
    kept = _between(tenant)
    _between(tenant, task="a")
    # the same after the deltas are folded into the tally
    episode_tally_fold()
    assert not EpisodeTallyDelta.objects.exists()
    assert _between(tenant)["by_class"] == kept["by_class"]
    # the scan the API still uses says the same
    scanned = selectors.episode_stats(episodes=selectors.episode_list(tenant=tenant))
    assert (scanned.episodes, scanned.by_class) == (kept["episodes"], kept["by_class"])
    assert scanned.cost >= kept["cost"]
    return kept


def test_kept_numbers_equal_a_recount_as_episodes_change(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    live = _sandbox(tenant, started_ago=timedelta(hours=2))
    ending = _sandbox(tenant, started_ago=timedelta(hours=1))
    left_open = _sandbox(tenant, started_ago=timedelta(hours=3))
    _close(_open(other, "a"), reward=1.0)  # another team's: in none of the figures

    # created
    on_live = _open(tenant, "a", [live])
    shared = _open(tenant, "a", [live, ending])
    bare = _open(tenant, "b")
    on_open_usage = _open(tenant, "b", [left_open])
    assert _agree(tenant)["open"] == 4

    # ended (closed): every cost still computed now (nothing settled)
    _close(on_live, reward=1.0)
    _close(shared, reward=0.0, client_cost="0.25")
    _close(bare, reward=1.0, client_cost="0.10")
    _close(on_open_usage, reward=0.0)
    kept = _agree(tenant)
    assert (kept["episodes"], kept["open"]) == (4, 0)
    assert kept["by_class"]["success"] == 2 and kept["by_class"]["task"] == 2
    assert kept["cost"] > Decimal("0.35")

    # settled: only the episode without sandboxes can be; the others' still accrue
    assert episodes_settle_costs() == 2  # and the other team's, which has none either
    final = Episode.objects.filter(tenant=tenant, cost_final=True)
    assert set(final.values_list("pk", flat=True)) == {bare.pk}
    _agree(tenant)

    # sandbox costs landing late: one sandbox ends after its episodes closed, another
    # ends but its usage record is closed only later
    _end(ending)
    _end(left_open, close_usage=False)
    _agree(tenant)
    assert episodes_settle_costs() == 0  # ``shared`` still has ``live``; the record is open
    UsageRecord.objects.filter(sandbox=left_open).update(
        ended_at=timezone.now(), end_state="deleted"
    )
    assert episodes_settle_costs() == 1
    _end(live)
    assert episodes_settle_costs() == 2
    assert not Episode.objects.filter(tenant=tenant, cost_final=False).exists()
    kept = _agree(tenant)
    # the whole cost of the three sandboxes plus the client costs, now all final
    full = sum(
        (episode_sandbox_cost(episode=e)[0] for e in Episode.objects.filter(tenant=tenant)),
        Decimal(0),
    )
    assert kept["cost"] == (full + Decimal("0.35")).quantize(QUANTUM)

    # a person relabels one: it moves between classes
    episode_relabel(
        episode=Episode.objects.get(pk=on_open_usage.pk),
        failure_class=FailureClass.ENVIRONMENT,
        reason="the sandbox was broken",
        actor="t",
    )
    assert _agree(tenant)["by_class"]["environment"] == 1
    # a filter the tally does not key: over the matching rows (exact here: few match)
    relabeled = selectors.episode_numbers(tenant=tenant, filters={"relabeled": "true"})
    assert (relabeled.scanned, relabeled.stats.episodes) == (None, 1)
    assert relabeled.stats.by_class["environment"] == 1
    others = selectors.episode_numbers(tenant=tenant, filters={"relabeled": "false"})
    assert (others.stats.episodes, others.stats.by_class["environment"]) == (3, 0)

    # deleted
    withdraw(tenant=tenant, request={"episode_ids": [shared.episode_id]}, reason="r", actor="t")
    # ``on_live`` no longer shares ``live``: its stored half is not final any more
    assert not Episode.objects.get(pk=on_live.pk).cost_final
    kept = _agree(tenant)
    assert kept["episodes"] == 3
    assert episodes_settle_costs() == 1
    assert Episode.objects.get(pk=on_live.pk).cost_final
    assert _agree(tenant) == kept
    assert selectors.task_ids(tenant=tenant) == ["a", "b"]
    withdraw(tenant=tenant, request={"episode_ids": [on_live.episode_id]}, reason="r", actor="t")
    _agree(tenant)
    assert selectors.task_ids(tenant=tenant) == ["b"]


def test_many_still_accruing_are_costed_as_stored_and_the_page_says_so(
    make_tenant: Any, make_user: Any, monkeypatch: Any
) -> None:
    tenant, _ = make_tenant()
    live = _sandbox(tenant, started_ago=timedelta(hours=1))
    for _ in range(3):
        _close(_open(tenant, "a", [live], model="m1"), reward=1.0)
    _close(_open(tenant, "a", model="m2"), reward=0.0, client_cost="0.5")
    episodes_settle_costs()
    stored = sum(Episode.objects.filter(tenant=tenant).values_list("cost", flat=True))
    monkeypatch.setattr(selectors, "STATS_LIVE_LIMIT", 2)
    stats, as_stored = selectors.episode_stats_kept(tenant=tenant)
    assert (as_stored, stats.cost) == (3, Decimal(stored).quantize(QUANTUM))

    client = Client()
    client.force_login(make_user("viewer-n", (tenant, "viewer")))
    page = client.get("/trajectories/").content.decode()
    assert 'data-as-stored="3"' in page
    # a filter the tally does not keep: over the matching rows, bounded and said so
    monkeypatch.setattr(selectors, "STATS_SCAN_LIMIT", 2)
    page = client.get("/trajectories/", {"model": "m1"}).content.decode()
    assert 'data-scanned="2"' in page
    assert 'data-stat="episodes"><div class="v">2<' in page
    numbers = selectors.episode_numbers(tenant=tenant, filters={"model": "m2"})
    assert (numbers.scanned, numbers.stats.episodes, numbers.stats.cost) == (
        None,
        1,
        Decimal("0.5"),
    )


TABLES = (
    "trajectories_episode",
    "trajectories_episodetally",
    "trajectories_episodetallydelta",
    "trajectories_episodesandbox",
    "trajectories_step",
    "sandboxes_sandbox",
    "sandboxes_sandboxevent",
    "billing_usagerecord",
)


def _rows_read() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
            [list(TABLES)],
        )
        return int(cursor.fetchone()[0])


def _history(tenant: Any, n: int, tasks: int = 7) -> None:
    """``n`` closed episodes with final costs, spread over ``tasks`` tasks and the
    classes, started over the last days (rows, as the generator's history would be)."""
    now = timezone.now()
    classes = [FailureClass.SUCCESS, FailureClass.TASK, FailureClass.ENVIRONMENT]
    Episode.objects.bulk_create(
        Episode(
            tenant=tenant,
            task_id=f"task-{i % tasks}",
            status="closed",
            started_at=now - timedelta(minutes=5 * i + 1),
            ended_at=now - timedelta(minutes=5 * i),
            failure_class=classes[i % 3],
            auto_failure_class=classes[i % 3],
            cost=Decimal("0.125"),
            cost_final=True,
        )
        for i in range(n)
    )


def test_the_list_page_reads_the_same_at_two_sizes_of_history(
    make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    client = Client()
    client.force_login(make_user("viewer-h", (tenant, "viewer")))
    measured: dict[int, tuple[int, int]] = {}
    total = 0
    # Both above the time panel's 500 newest; and big enough that the planner walks the
    # started_at index for it (at 600 it read all 600 and sorted them).
    for n in (1200, 3600):
        _history(tenant, n - total)
        total = n
        episode_tally_fold()
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {', '.join(TABLES)}")
            # read through the indexes, as at 10^5 rows (see test_background_costs.py)
            cursor.execute("SET LOCAL enable_seqscan = off")
        client.get("/trajectories/")  # session and caches warm
        before = _rows_read()
        with CaptureQueriesContext(connection) as queries:
            response = client.get("/trajectories/")
        assert response.status_code == 200
        measured[n] = (len(queries), _rows_read() - before)
        page = response.content.decode()
        assert f'data-stat="episodes"><div class="v">{n}<' in page
        assert "data-as-stored" not in page and "data-scanned" not in page
    assert measured[1200] == measured[3600], measured
    # seven tasks: every one in the per-task table
    assert page.count('<td><a href="?task=task-') == 7 and "per-task-shown" not in page


def test_the_per_task_table_shows_the_tasks_with_most_rollouts(
    make_tenant: Any, make_user: Any, monkeypatch: Any
) -> None:
    from apps.trajectories import views

    tenant, _ = make_tenant()
    _history(tenant, 12, tasks=4)  # task-0..3 with 3 rollouts each
    _history(tenant, 2, tasks=1)  # task-0 gets 2 more
    episode_tally_fold()
    monkeypatch.setattr(views, "TASKS_SHOWN", 2)
    client = Client()
    client.force_login(make_user("viewer-t", (tenant, "viewer")))
    page = client.get("/trajectories/").content.decode()
    assert 'data-shown="2" data-tasks="4"' in page
    # task-0 (5 rollouts) and, of the three tied at 3, the first by id
    shown = [t for t in ("task-0", "task-1", "task-2", "task-3") if f'href="?task={t}"' in page]
    assert shown == ["task-0", "task-1"]
    assert 'data-stat="tasks"' in page  # the summary still counts all four


def _episode_rows_read() -> int:
    with connection.connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = 'trajectories_episode'"
        )
        row = cursor.fetchone()
        assert row is not None
        return int(row[0])


def test_the_stats_api_is_exact_and_reads_the_tally(make_tenant: Any, api_client: Any) -> None:
    # GET /api/v1/episodes/stats counted every matching episode on every call; under
    # the filters the tally keeps it now reads the tally (plus the episodes whose cost is
    # not final yet), and says exactly what the scan of every row says
    tenant, secret = make_tenant()
    api = api_client(secret)
    live = _sandbox(tenant, started_ago=timedelta(minutes=5))
    _close(_open(tenant, "a", [live]), reward=1.0)  # its cost still accrues: computed now
    _open(tenant, "b")
    read = []
    made = 1  # closed so far
    for n in (5, 60):
        made += n
        for i in range(n):
            _close(_open(tenant, "ab"[i % 2], model="m1" if i % 3 else "m2"), reward=i % 2)
        for filters in ({}, {"task": "a"}, {"status": "closed"}, {"model": "m2"}):
            exact = selectors.episode_stats_exact(tenant=tenant, filters=filters)
            scanned = selectors.episode_stats(
                episodes=selectors.episode_list(tenant=tenant, filters=filters)
            )
            # the live sandbox accrues between the two reads: all but its cent-fractions
            assert {**exact.as_dict(), "cost": 0, "cost_per_valid": 0} == {
                **scanned.as_dict(),
                "cost": 0,
                "cost_per_valid": 0,
            }, filters
            assert abs(exact.cost - scanned.cost) < Decimal("0.001")
        episodes_settle_costs()  # as the beat does each minute: the finished costs stored
        before = _episode_rows_read()
        body = api.get("/api/v1/episodes/stats").json()
        read.append(_episode_rows_read() - before)
        assert body["episodes"] == made and body["open_episodes"] == 1
    # the closed episode with a live sandbox, whatever the history: not every episode
    assert read[0] == read[1] < 10, read
