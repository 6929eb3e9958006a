"""The tallies ``/metrics`` keeps on write (services/metrics_tally.py, migration 0015)
are exactly what a full recount of the rows gives, after inserts, updates, deletes,
rolled-back transactions, retention's summaries and folds."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import Count
from django.utils import timezone

from apps.sandboxes.metrics import READY_BUCKETS, HedgerowCollector
from apps.sandboxes.models import (
    EXEC_BUCKETS,
    MetricsDelta,
    MetricsFold,
    Operation,
    Sandbox,
    State,
)
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_transition
from apps.sandboxes.services.metrics_tally import tallies, tallies_rebuild
from apps.sandboxes.services.retention import operation_summary_totals, retention_apply

pytestmark = pytest.mark.django_db

Histogram = tuple[tuple[float, ...], float, float]  # cumulative counts, count, sum


def _histogram_recount(table: str, start: str, end: str, buckets: tuple[float, ...]) -> Histogram:
    """The query the scrape ran before the tallies: every row, each time."""
    duration = f"EXTRACT(EPOCH FROM ({end} - {start}))"
    parts = [f"count(*) FILTER (WHERE {duration} <= {float(le)!r})" for le in buckets]
    parts += ["count(*)", f"coalesce(sum({duration}), 0)"]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(parts)} FROM {table} WHERE {end} IS NOT NULL")
        row = cursor.fetchone()
    return tuple(float(c) for c in row[: len(buckets)]), float(row[-2]), float(row[-1])


def recount() -> dict[str, Any]:
    """Every figure from the rows themselves (and retention's summaries)."""
    summarized = operation_summary_totals()
    sandboxes = {
        (row["state"], row["tenant__slug"]): float(row["n"])
        for row in Sandbox.objects.values("state", "tenant__slug").annotate(n=Count("id"))
    }
    counts, total, seconds = _histogram_recount(
        "sandboxes_operation", "created_at", "finished_at", EXEC_BUCKETS
    )
    exec_ = (
        tuple(a + b for a, b in zip(counts, summarized["buckets"], strict=True)),
        total + summarized["finished"],
        seconds + summarized["duration_s"],
    )
    errors = {code: float(n) for code, n in summarized["errors"].items()}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(error->>'code', 'unknown'), count(*) FROM sandboxes_operation "
            "WHERE status = 'failed' GROUP BY 1"
        )
        for code, n in cursor.fetchall():
            errors[code] = errors.get(code, 0.0) + n
    return {
        "sandboxes": sandboxes,
        "queue": {
            stage: sum(n for (state, _), n in sandboxes.items() if state == stage)
            for stage in ("queued", State.REQUESTED)
        },
        "ready": _histogram_recount("sandboxes_sandbox", "created_at", "ready_at", READY_BUCKETS),
        "exec": exec_,
        "errors": errors,
    }


def scraped() -> dict[str, Any]:
    """The same figures as a scrape reports them."""
    families = {f.name: f for f in HedgerowCollector().collect()}

    def histogram(name: str) -> Histogram:
        samples = families[name].samples
        buckets = tuple(s.value for s in samples if s.name.endswith("_bucket"))
        (count,) = (s.value for s in samples if s.name.endswith("_count"))
        (seconds,) = (s.value for s in samples if s.name.endswith("_sum"))
        return buckets[:-1], count, seconds

    return {
        "sandboxes": {
            (s.labels["state"], s.labels["tenant"]): s.value
            for s in families["hedgerow_sandboxes"].samples
        },
        "queue": {
            s.labels["stage"]: s.value for s in families["hedgerow_admission_queue_depth"].samples
        },
        "ready": histogram("hedgerow_sandbox_create_to_ready_seconds"),
        "exec": histogram("hedgerow_exec_duration_seconds"),
        "errors": {s.labels["code"]: s.value for s in families["hedgerow_agent_errors"].samples},
    }


def assert_exact() -> None:
    want, got = recount(), scraped()
    for name in ("sandboxes", "queue", "errors"):
        assert got[name] == want[name], name
    for name in ("ready", "exec"):
        assert got[name][:2] == want[name][:2], name  # bucket counts and count: exact
        assert got[name][2] == pytest.approx(want[name][2], abs=1e-5), name  # the sum


def _sandbox(tenant: Any, path: Sequence[tuple[str, str]]) -> Sandbox:
    sandbox, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(image="host", cpu_millis=250, memory_mib=128),
        idempotency_key=None,
        actor="test",
    )
    for to_state, reason in path:
        extra: dict[str, Any] = {}
        if to_state == State.READY:
            extra["ready_at"] = timezone.now()
        if to_state == State.PROVISIONING:
            extra["provisioning_started_at"] = timezone.now()
        if to_state in (State.DELETED, State.LOST):
            extra["terminated_at"] = timezone.now()
        assert sandbox_transition(
            sandbox=sandbox,
            from_states=(sandbox.state,),
            to_state=to_state,
            reason=reason,
            bump_generation=to_state == State.PROVISIONING,
            **extra,
        )
    return sandbox


READY = [(State.PROVISIONING, "scheduled"), (State.READY, "agent_healthy")]
DELETED = [*READY, (State.TERMINATING, "deleted"), (State.DELETED, "destroyed")]


def _op(sandbox: Sandbox, seconds: float | None, *, code: str | None = None) -> Operation:
    """A finished operation of ``seconds`` (None: still running), failed with ``code``."""
    at = timezone.now() - timedelta(minutes=1)
    return Operation.objects.create(
        tenant_id=sandbox.tenant_id,
        sandbox=sandbox,
        operation_id=f"op-{uuid.uuid4().hex[:12]}",
        generation=sandbox.generation,
        request={"command": ["true"]},
        request_hash="h",
        status="running" if seconds is None else ("failed" if code else "completed"),
        error={"code": code, "message": "x"} if code else None,
        created_at=at,
        finished_at=None if seconds is None else at + timedelta(seconds=seconds),
    )


def test_the_bucket_bounds_of_the_triggers_are_the_metrics() -> None:
    migration = importlib.import_module("apps.sandboxes.migrations.0015_metrics_tallies")
    assert migration.READY_BOUNDS == READY_BUCKETS
    assert migration.EXEC_BOUNDS == EXEC_BUCKETS


def test_the_tallies_equal_a_full_recount_through_every_kind_of_change(
    make_tenant: Any, settings: Any
) -> None:
    settings.HEDGEROW_RETENTION_OUTPUT_DAYS = 30
    settings.HEDGEROW_RETENTION_OPERATION_DAYS = 90
    one, _ = make_tenant()
    two, _ = make_tenant()
    # inserts and transitions through the real services, two tenants
    live = [_sandbox(one, READY) for _ in range(3)] + [_sandbox(two, READY)]
    ended = [_sandbox(one, DELETED) for _ in range(2)]
    queued = _sandbox(two, [])
    ops = [_op(live[0], s) for s in (0.004, 0.05, 0.0501, 0.7, 700.0)]  # bounds and +Inf
    ops += [_op(live[1], 0.2, code="agent_unreachable"), _op(live[1], 3.0, code="agent_error")]
    running = _op(live[2], None)
    assert_exact()
    assert MetricsDelta.objects.count() == 0  # the scrape folded them

    # updates after a fold: a transition, a resume setting ready_at again, an operation
    # finishing, a failed one stored again with its real result, a bulk update
    assert sandbox_transition(
        sandbox=live[3], from_states=(State.READY,), to_state=State.TERMINATING, reason="deleted"
    )
    Sandbox.objects.filter(pk=live[2].pk).update(ready_at=timezone.now() + timedelta(seconds=7))
    Operation.objects.filter(pk=running.pk).update(
        status="completed", finished_at=running.created_at + timedelta(seconds=0.3)
    )
    Operation.objects.filter(pk=ops[5].pk).update(status="completed", error=None)
    Operation.objects.filter(pk=ops[6].pk).update(error={"code": "interrupted"})
    Sandbox.objects.filter(pk=queued.pk).update(state="queued")
    assert MetricsDelta.objects.exists()  # written by the triggers, not folded yet
    assert_exact()

    # deletes: bare rows (nothing points at them) and an operation
    bare = Sandbox.objects.bulk_create(
        Sandbox(
            tenant=two,
            external_id=f"x-{uuid.uuid4().hex[:12]}",
            state=State.READY,
            image="host",
            cpu_millis=1000,
            memory_mib=512,
            ttl_seconds=60,
            expires_at=timezone.now(),
            backend="local",
            ready_at=timezone.now(),
        )
        for _ in range(3)
    )
    assert_exact()
    Sandbox.objects.filter(pk__in=[s.pk for s in bare[:2]]).delete()
    Operation.objects.filter(pk=ops[0].pk).delete()
    assert_exact()

    # a transaction rolled back leaves no trace
    with pytest.raises(RuntimeError), transaction.atomic():
        Sandbox.objects.filter(pk=bare[2].pk).update(state=State.LOST)
        _op(live[0], 1.5, code="agent_error")
        raise RuntimeError
    assert_exact()

    # retention summarizes an ended sandbox's operations and deletes them
    _op(ended[0], 0.02)
    _op(ended[0], 9.0, code="agent_unreachable")
    Sandbox.objects.filter(pk=ended[0].pk).update(updated_at=timezone.now() - timedelta(days=120))
    before = scraped()
    result = retention_apply()
    assert result.sandboxes_summarized == 1
    assert not Operation.objects.filter(sandbox=ended[0]).exists()
    assert_exact()
    after = scraped()
    assert after["exec"][:2] == before["exec"][:2] and after["errors"] == before["errors"]

    # and once more after a fold with nothing since
    tallies()
    assert MetricsDelta.objects.count() == 0
    assert_exact()


def test_a_lost_fold_is_rebuilt_from_the_rows(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    sandboxes = [_sandbox(tenant, READY) for _ in range(2)] + [_sandbox(tenant, DELETED)]
    _op(sandboxes[0], 0.3)
    _op(sandboxes[1], 2.0, code="agent_error")
    assert_exact()
    right = scraped()
    MetricsFold.objects.filter(name="tallies").delete()  # lost by hand
    assert scraped() != right  # what was folded is gone
    tallies_rebuild()
    assert_exact()
    assert scraped() == right
    assert MetricsDelta.objects.count() == 0


def test_the_minutely_fold_task_empties_the_deltas(make_tenant: Any, settings: Any) -> None:
    from apps.sandboxes.tasks import fold_metrics

    assert settings.CELERY_BEAT_SCHEDULE["fold-metrics"]["task"] == (
        "apps.sandboxes.tasks.fold_metrics"
    )
    tenant, _ = make_tenant()
    _op(_sandbox(tenant, READY), 0.01)
    assert MetricsDelta.objects.filter(name="exec").exists()
    assert fold_metrics() >= 2  # sandboxes, ready, exec
    assert MetricsDelta.objects.count() == 0
    assert_exact()
