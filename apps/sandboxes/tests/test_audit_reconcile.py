"""Reconciler and leak audit against the real local backend (no web or worker needed:
the services run in the test process; resources are real netns/processes/dirs)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import BackendError, SandboxSpec
from apps.sandboxes.models import AuditRun, Sandbox, SandboxEvent, State
from apps.sandboxes.services import reconcile
from apps.sandboxes.services.audit import AuditSlice, audit_compute, audit_run
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_transition
from apps.sandboxes.services.reconcile import sandbox_reconcile

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db]


@pytest.fixture(autouse=True)
def _no_resources_left() -> Iterator[None]:
    yield
    backend = get_backend()
    for sid in {i.sandbox_id for i in backend.inventory() if i.sandbox_id}:
        backend.destroy(sid)


def _spec(sandbox_id: str, generation: int = 1) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id=sandbox_id,
        tenant_id="t",
        generation=generation,
        image="host",
        cpu_millis=250,
        memory_mib=128,
        network_access=False,
        agent_token="token-" + sandbox_id,
    )


def _sandbox(tenant: Any, path: Sequence[tuple[str, str]], image: str = "host") -> Sandbox:
    """A record walked through ``path`` [(to_state, reason)] by the real services."""
    sandbox, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(image=image, cpu_millis=250, memory_mib=128),
        idempotency_key=None,
        actor="test",
    )
    for to_state, reason in path:
        extra: dict[str, Any] = {}
        if to_state == State.READY:
            extra["ready_at"] = timezone.now() - timedelta(seconds=5)
        if to_state == State.PROVISIONING:
            extra["provisioning_started_at"] = timezone.now()
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


def _ended(reason: str) -> list[tuple[str, str]]:
    return [*READY, (State.TERMINATING, reason), (State.DELETED, "destroyed")]


def test_it_reclaims_a_resource_that_has_no_record(make_tenant: Any) -> None:
    stray = uuid.uuid4().hex
    get_backend().provision(_spec(stray))

    run = sandbox_reconcile()

    assert not run.skipped
    assert run.actions == {"leak_reclaimed": 1}
    assert run.details[0]["reason"] == "no_record"
    assert "process" in run.details[0]["kinds"]
    assert not [i for i in get_backend().inventory() if i.sandbox_id == stray]


def test_it_reclaims_resources_of_a_deleted_record_and_writes_the_ledger(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    sandbox = _sandbox(tenant, _ended("deleted"))
    get_backend().provision(_spec(sandbox.id.hex))

    run = sandbox_reconcile()

    assert run.actions == {"leak_reclaimed": 1}
    event = SandboxEvent.objects.get(sandbox=sandbox, event="leak_reclaimed")
    assert (event.reason, event.actor) == ("record_deleted", "reconciler")
    assert "directory:" in event.message
    assert not [i for i in get_backend().inventory() if i.sandbox_id == sandbox.id.hex]


def test_it_marks_a_ready_record_without_a_running_process_lost(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    gone = _sandbox(tenant, READY)
    alive = _sandbox(tenant, READY)
    get_backend().provision(_spec(alive.id.hex, alive.generation))

    run = sandbox_reconcile()

    gone.refresh_from_db()
    alive.refresh_from_db()
    assert (gone.state, alive.state) == (State.LOST, State.READY)
    last = SandboxEvent.objects.filter(sandbox=gone, event="transition").last()
    assert last is not None
    assert (last.to_state, last.reason, last.actor) == ("lost", "resource_missing", "reconciler")
    assert run.actions == {"resource_missing": 1}


def test_it_fails_a_provisioning_record_past_its_deadline(make_tenant: Any, settings: Any) -> None:
    settings.HEDGEROW_PENDING_TIMEOUT_S = 60
    tenant, _ = make_tenant()
    stuck = _sandbox(tenant, [(State.PROVISIONING, "scheduled")])
    fresh = _sandbox(tenant, [(State.PROVISIONING, "scheduled")])
    get_backend().provision(_spec(stuck.id.hex, stuck.generation))
    Sandbox.objects.filter(pk=stuck.pk).update(
        provisioning_started_at=timezone.now() - timedelta(seconds=61)
    )

    run = sandbox_reconcile()

    stuck.refresh_from_db()
    fresh.refresh_from_db()
    assert (stuck.state, stuck.status_message) == (
        State.FAILED,
        "still provisioning after the deadline (worker lost?)",
    )
    assert fresh.state == State.PROVISIONING
    assert run.actions == {"provision_deadline": 1}
    assert not [i for i in get_backend().inventory() if i.sandbox_id == stuck.id.hex]


def test_it_skips_the_round_when_the_inventory_listing_fails(
    make_tenant: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant, _ = make_tenant()
    ready = _sandbox(tenant, READY)  # no resources: would be marked lost

    def broken() -> list[Any]:
        raise BackendError("ip netns list timed out", transient=True)

    monkeypatch.setattr(get_backend(), "inventory", broken)
    run = sandbox_reconcile()
    monkeypatch.undo()

    ready.refresh_from_db()
    assert ready.state == State.READY
    assert run.skipped and "ip netns list timed out" in run.skip_reason
    assert run.actions == {}


def test_it_lets_one_reconciler_act_while_another_holds_the_lock(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    ready = _sandbox(tenant, READY)
    params = connection.get_connection_params()
    with psycopg.connect(
        dbname=params["dbname"],
        user=params["user"],
        password=params.get("password"),
        host=params["host"],
        port=params["port"],
    ) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [reconcile._lock_key()])
        run = sandbox_reconcile()
    ready.refresh_from_db()
    assert run.skipped and run.skip_reason == "another reconciler is running"
    assert ready.state == State.READY
    assert sandbox_reconcile().actions == {"resource_missing": 1}


def test_it_accounts_every_created_sandbox_in_exactly_one_term(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    start = timezone.now()
    _sandbox(tenant, _ended("deleted"))
    _sandbox(tenant, _ended("deleted"))
    _sandbox(tenant, _ended("ttl_expired"))
    _sandbox(tenant, _ended("heartbeat_expired"))
    _sandbox(tenant, [(State.PROVISIONING, "scheduled"), (State.FAILED, "provision_error")])
    _sandbox(tenant, [(State.FAILED, "pending_timeout")])
    _sandbox(tenant, [*READY, (State.LOST, "backend_resource_gone")])
    live = _sandbox(tenant, READY)
    get_backend().provision(_spec(live.id.hex, live.generation))
    leaked = _sandbox(tenant, _ended("deleted"))
    get_backend().provision(_spec(leaked.id.hex))
    _sandbox(other, _ended("deleted"))

    report = audit_compute(
        period_start=start,
        period_end=timezone.now(),
        audit_slice=AuditSlice(tenant=tenant),
    )

    assert report.created == 9
    assert report.terms == {
        "deleted": 2,
        "reaped_ttl": 1,
        "reaped_heartbeat": 1,
        "failed": 2,
        "lost": 1,
        "live": 1,
        "leaked": 1,
    }
    assert report.balanced is True  # a leak is a term of the equation, not an imbalance
    assert report.leaked_ids == [str(leaked.id)]
    assert report.residual_by_kind["process"] == 1 and report.residual_by_kind["directory"] == 1
    assert report.reasons["failed"] == {"provision_error": 1, "pending_timeout": 1}
    assert report.imbalance == {}
    assert report.equation().startswith("created 9 = deleted 2 + reaped_ttl 1")
    assert report.ghosts == []


def test_it_flags_a_record_the_ledger_does_not_explain_with_its_id(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    start = timezone.now()
    _sandbox(tenant, _ended("deleted"))
    silent = _sandbox(tenant, READY)
    # Someone changed the row behind the ledger's back, and its creation event is gone.
    Sandbox.objects.filter(pk=silent.pk).update(state=State.DELETED)
    SandboxEvent.objects.filter(sandbox=silent, event="created").delete()

    report = audit_compute(
        period_start=start, period_end=timezone.now(), audit_slice=AuditSlice(tenant=tenant)
    )

    assert report.balanced is False
    assert report.created == 1 and report.accounted == 2
    assert report.imbalance["no_created_event"] == [str(silent.id)]
    assert report.imbalance["ledger_disagrees"] == [str(silent.id)]
    assert report.imbalance["unexplained"] == [str(silent.id)]


def test_it_warns_when_ttl_reaps_dominate_and_when_their_share_rises(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    start = timezone.now()
    for _ in range(3):
        _sandbox(tenant, _ended("deleted"))
    first = audit_run(period_start=start, audit_slice=AuditSlice(tenant=tenant))
    assert first.report["warnings"] == [] and first.ttl_share == 0.0
    _sandbox(tenant, _ended("ttl_expired"))

    second = audit_run(period_start=start, audit_slice=AuditSlice(tenant=tenant))

    assert second.ttl_share == 0.25
    warnings = second.report["warnings"]
    assert any("25% of ended sandboxes were reaped by TTL" in w for w in warnings)
    assert any("rising: 0% → 25%" in w for w in warnings)


def test_it_reclaims_what_the_audit_finds_and_stores_the_run(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    start = timezone.now()
    leaked = _sandbox(tenant, _ended("deleted"))
    get_backend().provision(_spec(leaked.id.hex))
    orphan = uuid.uuid4().hex
    get_backend().provision(_spec(orphan))

    run = audit_run(period_start=start, reclaim=True)

    assert (run.leaked, run.orphaned, run.reclaimed, run.balanced) == (1, 1, 2, False)
    assert run.report["orphaned"] == [orphan]
    assert SandboxEvent.objects.filter(sandbox=leaked, event="leak_reclaimed").count() == 1
    assert not [i for i in get_backend().inventory() if i.sandbox_id in (orphan, leaked.id.hex)]
    after = audit_run(period_start=start)
    assert (after.leaked, after.orphaned, after.balanced) == (0, 0, True)
    assert AuditRun.objects.count() == 2


def test_it_requeues_a_request_no_worker_picked_up(
    make_tenant: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.HEDGEROW_REQUEUE_AFTER_S = 30
    tenant, _ = make_tenant()
    stalled = _sandbox(tenant, [])
    fresh = _sandbox(tenant, [])
    Sandbox.objects.filter(pk=stalled.pk).update(updated_at=timezone.now() - timedelta(seconds=31))
    enqueued: list[str] = []
    monkeypatch.setattr("apps.sandboxes.tasks.provision_sandbox.delay", enqueued.append)

    run = sandbox_reconcile()

    assert enqueued == [str(stalled.id)]
    assert run.actions == {"provision_requeued": 1}
    event = SandboxEvent.objects.get(sandbox=stalled, event="provision_requeued")
    assert (event.reason, event.actor) == ("stalled_request", "reconciler")
    assert not SandboxEvent.objects.filter(sandbox=fresh, event="provision_requeued").exists()
    # The next round waits again before re-enqueueing the same sandbox.
    assert sandbox_reconcile().actions == {}
