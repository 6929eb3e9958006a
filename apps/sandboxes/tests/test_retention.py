"""Retention (services/retention.py): an ended sandbox's output windows and then its
operation rows are thinned after N days, while the ledger, the usage records, the
audit's equation and the metrics stay exactly what they were."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.billing.models import UsageRecord
from apps.billing.usage import cost_for_sandboxes
from apps.core.redis_sync import redis_client
from apps.sandboxes.api.serializers import render_stream
from apps.sandboxes.metrics import HedgerowCollector
from apps.sandboxes.models import (
    EXEC_BUCKETS,
    RETENTION_FULL,
    RETENTION_OUTPUT_PRUNED,
    RETENTION_SUMMARIZED,
    Operation,
    OperationSummary,
    Sandbox,
    SandboxEvent,
    State,
)
from apps.sandboxes.services import replay
from apps.sandboxes.services.audit import AuditSlice, audit_compute
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_transition
from apps.sandboxes.services.reconcile import InventoryView
from apps.sandboxes.services.retention import retention_apply

pytestmark = pytest.mark.django_db

READY = [(State.PROVISIONING, "scheduled"), (State.READY, "agent_healthy")]
DELETED = [*READY, (State.TERMINATING, "deleted"), (State.DELETED, "destroyed")]
LOST = [*READY, (State.LOST, "resource_missing")]
DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def _policy(settings: Any) -> None:
    settings.HEDGEROW_RETENTION_OUTPUT_DAYS = 30
    settings.HEDGEROW_RETENTION_OPERATION_DAYS = 90
    settings.HEDGEROW_RETENTION_BATCH = 500
    settings.HEDGEROW_RETENTION_MAX_BATCHES = 20


def _sandbox(tenant: Any, path: Sequence[tuple[str, str]]) -> Sandbox:
    """A record walked through ``path`` by the real services (ledger and usage too)."""
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


def _ops(sandbox: Sandbox, n: int, *, failed: int = 0, at: datetime | None = None) -> list[Any]:
    """``n`` finished operations (the last ``failed`` of them failed), durations
    0.02 s, 0.2 s, 2 s, … so they fall into different histogram buckets."""
    at = at or timezone.now()
    rows = []
    for i in range(n):
        is_failed = i >= n - failed
        rows.append(
            Operation.objects.create(
                tenant_id=sandbox.tenant_id,
                sandbox=sandbox,
                operation_id=f"op-{uuid.uuid4().hex[:12]}",
                generation=sandbox.generation,
                request={"command": ["echo", str(i)]},
                request_hash="h",
                status="failed" if is_failed else "completed",
                termination="agent_error" if is_failed else "exited",
                exit_code=None if is_failed else 0,
                stdout={"head": f"out {i}\n" * 3, "tail": "", "total_bytes": 18 + 3 * len(str(i))},
                stderr={"head": "", "tail": "", "total_bytes": 0},
                error={"code": "agent_unreachable", "message": "x"} if is_failed else None,
                created_at=at,
                finished_at=at + timedelta(seconds=0.02 * 10 ** (i % 3)),
            )
        )
    return [row.pk for row in rows]


def _ended_days_ago(sandbox: Sandbox, days: float) -> None:
    """What time does to an ended sandbox: its last transition was ``days`` ago."""
    Sandbox.objects.filter(pk=sandbox.pk).update(updated_at=timezone.now() - days * DAY)


def _metric_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    wanted = ("hedgerow_exec_duration_seconds", "hedgerow_agent_errors")
    out = {}
    for family in HedgerowCollector().collect():
        if family.name in wanted:
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _money_and_ledger(ids: list[Any]) -> tuple[Any, ...]:
    usage = list(
        UsageRecord.objects.filter(sandbox_id__in=ids)
        .order_by("sandbox_id")
        .values("sandbox_id", "started_at", "ended_at", "cpu_millis", "memory_mib", "pauses")
    )
    ledger = list(
        SandboxEvent.objects.filter(sandbox_id__in=ids)
        .order_by("id")
        .values_list("id", "sandbox_id", "at", "event", "from_state", "to_state", "reason")
    )
    end = timezone.now() + DAY  # a fixed window: a live sandbox's accrual is not compared
    return usage, ledger, cost_for_sandboxes(sandbox_ids=ids, end=end)


def _audit(tenant: Any, start: datetime) -> Any:
    return audit_compute(
        period_start=start,
        period_end=timezone.now() + DAY,
        audit_slice=AuditSlice(tenant=tenant),
        view=InventoryView(),
    )


def test_a_pruned_period_still_balances_and_costs_and_metrics_do_not_move(
    make_tenant: Any,
) -> None:
    tenant, _ = make_tenant()
    start = timezone.now() - DAY
    deleted = _sandbox(tenant, DELETED)
    lost = _sandbox(tenant, LOST)
    failed = _sandbox(tenant, [(State.PROVISIONING, "scheduled")])
    assert sandbox_transition(
        sandbox=failed,
        from_states=(State.PROVISIONING,),
        to_state=State.FAILED,
        reason="provision_error",
        terminated_at=timezone.now(),
    )
    _ops(deleted, 7, failed=2)
    _ops(lost, 4, failed=1)
    for sandbox in (deleted, lost, failed):
        _ended_days_ago(sandbox, 100)
    ids = [deleted.pk, lost.pk, failed.pk]
    before_audit = _audit(tenant, start)
    before_money = _money_and_ledger(ids)
    before_metrics = _metric_samples()
    assert before_audit.balanced and before_audit.created == 3

    result = retention_apply()

    assert (result.outputs_pruned, result.operations_summarized) == (11, 11)
    assert not Operation.objects.filter(sandbox_id__in=ids).exists()
    assert set(Sandbox.objects.filter(pk__in=ids).values_list("retention", flat=True)) == {
        RETENTION_SUMMARIZED
    }
    after_audit = _audit(tenant, start)
    assert after_audit.balanced
    assert (after_audit.created, after_audit.terms) == (before_audit.created, before_audit.terms)
    assert after_audit.reasons == before_audit.reasons
    assert _money_and_ledger(ids) == before_money
    assert _metric_samples() == pytest.approx(before_metrics)  # float sums
    summaries = {
        (s.sandbox_id, s.status, s.error_code): s
        for s in OperationSummary.objects.filter(sandbox_id__in=ids)
    }
    assert {k: s.count for k, s in summaries.items()} == {
        (deleted.pk, "completed", ""): 5,
        (deleted.pk, "failed", "agent_unreachable"): 2,
        (lost.pk, "completed", ""): 3,
        (lost.pk, "failed", "agent_unreachable"): 1,
    }
    assert all(s.tenant_id == tenant.pk for s in summaries.values())
    done = summaries[(deleted.pk, "completed", "")]
    # durations 0.02, 0.2, 2, 0.02, 0.2 s: bucket by bucket, cumulative
    assert done.buckets == [
        sum(1 for d in (0.02, 0.2, 2.0, 0.02, 0.2) if d <= le) for le in EXEC_BUCKETS
    ]
    assert done.duration_s == pytest.approx(2.44)

    # idempotent: nothing is left to do and nothing is counted twice
    again = retention_apply()
    assert (again.batches, again.outputs_pruned, again.operations_summarized) == (0, 0, 0)
    assert _metric_samples() == pytest.approx(before_metrics)  # float sums


def test_output_windows_go_first_and_the_rows_stay_until_their_own_deadline(
    make_tenant: Any,
) -> None:
    tenant, _ = make_tenant()
    ended = _sandbox(tenant, DELETED)
    pks = _ops(ended, 3)
    _ended_days_ago(ended, 40)
    client = redis_client()
    client.set(replay.frames_key(str(pks[0])), "frames")
    client.set(replay.bytes_key(str(pks[0])), "6")

    result = retention_apply()

    assert (result.outputs_pruned, result.operations_summarized) == (3, 0)
    assert result.stream_keys_deleted == 2
    assert not client.exists(replay.frames_key(str(pks[0])), replay.bytes_key(str(pks[0])))
    ended.refresh_from_db()
    assert ended.retention == RETENTION_OUTPUT_PRUNED
    op = Operation.objects.get(pk=pks[2])
    assert op.stdout == {"pruned": True, "total_bytes": 21, "truncated": None}
    assert op.exit_code == 0 and op.status == "completed" and op.request
    assert render_stream(op.stdout) == "[… output pruned by retention (21 bytes) …]"


def test_nothing_of_a_live_or_paused_sandbox_or_a_recent_end_is_pruned(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    other_tenant, _ = make_tenant()
    live = _sandbox(tenant, READY)
    live_ops = _ops(live, 3, at=timezone.now() - 200 * DAY)
    _ended_days_ago(live, 200)  # a sandbox alive for 200 days: still live
    paused = _sandbox(tenant, READY)
    Sandbox.objects.filter(pk=paused.pk).update(
        state=State.PAUSED, updated_at=timezone.now() - 200 * DAY
    )
    _ops(paused, 2, at=timezone.now() - 200 * DAY)
    recent = _sandbox(other_tenant, DELETED)  # another tenant's, ended 10 days ago
    _ops(recent, 2)
    _ended_days_ago(recent, 10)
    old = _sandbox(tenant, DELETED)
    _ops(old, 2)
    _ended_days_ago(old, 100)
    before = {
        row["pk"]: row
        for row in Operation.objects.exclude(sandbox=old).values("pk", "stdout", "stderr")
    }

    result = retention_apply()

    assert result.operations_summarized == 2  # only the old sandbox's
    after = {
        row["pk"]: row
        for row in Operation.objects.exclude(sandbox=old).values("pk", "stdout", "stderr")
    }
    assert after == before and set(live_ops) <= set(after)
    assert not OperationSummary.objects.filter(tenant=other_tenant).exists()
    assert set(OperationSummary.objects.values_list("sandbox_id", flat=True)) == {old.pk}
    retention = dict(Sandbox.objects.values_list("pk", "retention"))
    assert retention[live.pk] == retention[paused.pk] == retention[recent.pk] == RETENTION_FULL


def test_a_run_honours_its_batch_bound_and_the_next_run_goes_on(
    make_tenant: Any, settings: Any
) -> None:
    settings.HEDGEROW_RETENTION_BATCH = 5
    settings.HEDGEROW_RETENTION_MAX_BATCHES = 2
    tenant, _ = make_tenant()
    sandboxes = [_sandbox(tenant, DELETED) for _ in range(3)]
    for sandbox in sandboxes:
        _ops(sandbox, 4)
        _ended_days_ago(sandbox, 100)

    runs = []
    while True:
        with CaptureQueriesContext(connection) as queries:
            result = retention_apply()
        runs.append(result)
        assert result.batches <= 2
        assert result.outputs_pruned + result.operations_summarized <= 10
        # a batch is a bounded number of statements, whatever the history holds
        assert len(queries) <= 2 * 20
        if not result.more:
            break
        assert len(runs) < 10

    assert runs[0].more and runs[0].outputs_pruned == 10
    assert sum(r.outputs_pruned for r in runs) == 12
    assert sum(r.operations_summarized for r in runs) == 12
    assert sum(OperationSummary.objects.values_list("count", flat=True)) == 12
    assert not Operation.objects.filter(sandbox__in=sandboxes).exists()


def test_an_operation_a_trajectory_step_links_is_kept(make_tenant: Any) -> None:
    from apps.trajectories.models import Episode, Step

    tenant, _ = make_tenant()
    ended = _sandbox(tenant, DELETED)
    linked, free = _ops(ended, 2)
    episode = Episode.objects.create(tenant=tenant, task_id="t")
    Step.objects.create(episode=episode, index=0, operation_record_id=linked)
    _ended_days_ago(ended, 100)

    result = retention_apply()

    assert result.operations_summarized == 1
    assert list(Operation.objects.filter(sandbox=ended).values_list("pk", flat=True)) == [linked]
    assert Operation.objects.get(pk=linked).stdout["pruned"] is True
    assert Step.objects.get(episode=episode).operation_record_id == linked
    assert not Operation.objects.filter(pk=free).exists()
