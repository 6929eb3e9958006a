"""Snapshots in the reconciler (issue 16): a backend snapshot without a live record is
a leak and is removed; one with a ``capturing``/``ready`` record is kept; a capture
whose worker vanished is failed. Real local backend, real database."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.sandboxes.agent_client import agent_token
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import SandboxSpec
from apps.sandboxes.backends.local import wait_healthy
from apps.sandboxes.models import Snapshot, SnapshotState
from apps.sandboxes.services.audit import audit_compute
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create
from apps.sandboxes.services.reconcile import sandbox_reconcile

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db]


@pytest.fixture(autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    backend = get_backend()
    for sid in {i.sandbox_id for i in backend.inventory() if i.sandbox_id}:
        backend.destroy(sid)
    for snap in backend.snapshots():  # type: ignore[attr-defined]
        backend.delete_snapshot(snap)


def _snapshot_row(sandbox: Any, state: str, **fields: Any) -> Snapshot:
    return Snapshot.objects.create(
        tenant=sandbox.tenant,
        sandbox=sandbox,
        backend=sandbox.backend,
        image="host",
        state=state,
        ttl_seconds=3600,
        expires_at=timezone.now() + timedelta(hours=1),
        **fields,
    )


def _running_sandbox(make_tenant: Any) -> Any:
    tenant, _ = make_tenant()
    sandbox, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(image="host", cpu_millis=250, memory_mib=128),
        idempotency_key=None,
        actor="test",
    )
    backend = get_backend()
    spec = SandboxSpec(
        sandbox_id=sandbox.id.hex,
        tenant_id=str(tenant.pk),
        generation=1,
        image="host",
        cpu_millis=250,
        memory_mib=128,
        network_access=False,
        agent_token=agent_token(sandbox.id.hex, 1),
    )
    wait_healthy(backend.provision(spec), spec.agent_token, timeout=30)
    return sandbox


def test_it_removes_snapshots_without_a_live_record_and_keeps_the_others(
    make_tenant: Any,
) -> None:
    sandbox = _running_sandbox(make_tenant)
    backend = get_backend()
    kept = _snapshot_row(sandbox, SnapshotState.READY)
    deleted = _snapshot_row(sandbox, SnapshotState.DELETED)
    orphan = uuid.uuid4()
    for snap_id in (kept.id, deleted.id, orphan):
        backend.snapshot(sandbox.id.hex, snap_id.hex)
    lost = _snapshot_row(sandbox, SnapshotState.CAPTURING)
    Snapshot.objects.filter(pk=lost.pk).update(created_at=timezone.now() - timedelta(hours=2))

    run = sandbox_reconcile()

    assert run.actions.get("snapshot_leak_reclaimed") == 2
    assert run.actions.get("snapshot_capture_lost") == 1
    assert backend.snapshots() == [kept.id.hex]  # type: ignore[attr-defined]
    lost.refresh_from_db()
    assert lost.state == SnapshotState.FAILED
    assert lost.error == {"code": "capture_lost", "message": "still capturing after the deadline"}
    again = sandbox_reconcile()  # idempotent
    assert "snapshot_leak_reclaimed" not in again.actions
    assert backend.snapshots() == [kept.id.hex]  # type: ignore[attr-defined]


def test_the_audit_balances_snapshots_and_names_the_leaked_ones(make_tenant: Any) -> None:
    sandbox = _running_sandbox(make_tenant)
    backend = get_backend()
    start = timezone.now() - timedelta(minutes=1)
    live = _snapshot_row(sandbox, SnapshotState.READY)
    leaked = _snapshot_row(sandbox, SnapshotState.DELETED, deleted_reason="deleted")
    _snapshot_row(sandbox, SnapshotState.DELETED, deleted_reason="deleted")
    _snapshot_row(sandbox, SnapshotState.DELETED, deleted_reason="ttl_expired")
    _snapshot_row(sandbox, SnapshotState.FAILED)
    orphan = uuid.uuid4()
    for snap_id in (live.id, leaked.id, orphan):
        backend.snapshot(sandbox.id.hex, snap_id.hex)

    report = audit_compute(period_start=start, period_end=timezone.now() + timedelta(minutes=1))

    snaps = report.snapshots
    assert snaps.created == 5
    assert snaps.terms == {"deleted": 1, "expired": 1, "failed": 1, "live": 1, "leaked": 1}
    assert snaps.leaked_ids == [str(leaked.id)] and snaps.orphaned == [str(orphan)]
    assert report.as_dict()["snapshots"]["equation"] == (
        "snapshots created 5 = deleted 1 + expired 1 + failed 1 + live 1 + leaked 1"
    )
    assert any("snapshot(s) leaked" in w for w in report.warnings)
    sandbox_reconcile()  # removes the leaked and the orphaned copy
    after = audit_compute(period_start=start, period_end=timezone.now() + timedelta(minutes=1))
    assert after.snapshots.terms["leaked"] == 0 and after.snapshots.terms["deleted"] == 2
    assert after.snapshots.orphaned == []


def test_a_lost_pause_capture_puts_the_sandbox_back_to_ready(make_tenant: Any) -> None:
    from apps.sandboxes.models import SandboxEvent, State
    from apps.sandboxes.services.lifecycle import sandbox_transition

    sandbox = _running_sandbox(make_tenant)
    for to_state, reason in (
        (State.PROVISIONING, "scheduled"),
        (State.READY, "agent_healthy"),
        (State.PAUSED, "paused"),
    ):
        assert sandbox_transition(
            sandbox=sandbox,
            from_states=(sandbox.state,),
            to_state=to_state,
            reason=reason,
            bump_generation=to_state == State.PROVISIONING,
        )
    pause = _snapshot_row(sandbox, SnapshotState.CAPTURING, kind="pause")
    Snapshot.objects.filter(pk=pause.pk).update(created_at=timezone.now() - timedelta(hours=2))

    run = sandbox_reconcile()

    assert run.actions.get("snapshot_capture_lost") == 1
    sandbox.refresh_from_db()
    assert sandbox.state == State.READY
    assert SandboxEvent.objects.filter(
        sandbox=sandbox, to_state=State.READY, reason="pause_failed"
    ).exists()
