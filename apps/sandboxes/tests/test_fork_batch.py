"""A fork's K children are admitted and recorded as one (issue 16, "fork 64 in <= 2 s"):
one admission for the K under one quota lock, one multi-row insert of the rows and of
their ``created`` ledger rows, and their provisioning enqueued in shares after commit.
Real database; the provisioning itself is covered live (test_snapshots_live.py)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from django.utils import timezone

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.core.errors import ApiError
from apps.sandboxes.models import Sandbox, SandboxEvent, Snapshot, SnapshotState, State
from apps.sandboxes.services import provisioning
from apps.sandboxes.services import snapshots as snapshot_services
from apps.sandboxes.services.snapshots import snapshot_fork
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def _ready_snapshot(tenant: Any, **parent: Any) -> Snapshot:
    sandbox = make_sandbox(tenant, **parent)
    now = timezone.now()
    return Snapshot.objects.create(
        tenant=tenant,
        sandbox=sandbox,
        backend=sandbox.backend,
        image="host",
        image_digest="",
        state=SnapshotState.READY,
        ttl_seconds=3600,
        expires_at=now + timedelta(hours=1),
        generation=sandbox.generation,
    )


def _limit(tenant: Any, **limits: Any) -> None:
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(**limits)


def test_a_fork_records_its_k_children_with_one_ledger_row_each(make_tenant):
    tenant, _ = make_tenant()
    snap = _ready_snapshot(tenant, cpu_millis=500, memory_mib=256, labels={"run": "r1"})
    children, created = snapshot_fork(
        tenant=tenant, snapshot=snap, count=5, idempotency_key="k1", actor="key:test"
    )
    assert created and len(children) == 5
    rows = list(Sandbox.objects.filter(snapshot=snap).order_by("idempotency_key"))
    assert [r.idempotency_key for r in rows] == [f"k1:{i}" for i in range(5)]
    assert len({r.external_id for r in rows}) == 5
    for row in rows:
        assert row.state == State.REQUESTED and row.admitted_at is not None
        assert (row.cpu_millis, row.memory_mib, row.labels) == (500, 256, {"run": "r1"})
        assert row.tenant_id == tenant.pk and row.created_by == "key:test"
        events = list(SandboxEvent.objects.filter(sandbox=row))
        assert [(e.event, e.to_state, e.reason) for e in events] == [
            ("created", State.REQUESTED, "api")
        ]
    # the same key again: the same five, nothing more recorded
    again, created_again = snapshot_fork(
        tenant=tenant, snapshot=snap, count=5, idempotency_key="k1", actor="key:test"
    )
    assert not created_again and [c.pk for c in again] == [c.pk for c in children]
    assert Sandbox.objects.filter(snapshot=snap).count() == 5
    assert SandboxEvent.objects.filter(sandbox__snapshot=snap).count() == 5


def test_the_same_key_for_another_snapshot_is_a_409_and_records_nothing(make_tenant):
    tenant, _ = make_tenant()
    first, second = _ready_snapshot(tenant), _ready_snapshot(tenant)
    snapshot_fork(tenant=tenant, snapshot=first, count=2, idempotency_key="k2", actor="t")
    with pytest.raises(ApiError) as refused:
        snapshot_fork(tenant=tenant, snapshot=second, count=2, idempotency_key="k2", actor="t")
    assert refused.value.code == "idempotency_mismatch" and refused.value.status_code == 409
    assert Sandbox.objects.filter(snapshot=second).count() == 0


@pytest.mark.parametrize(
    ("limits", "limit_name"),
    [
        ({"max_concurrent_sandboxes": 4}, "max_concurrent_sandboxes"),
        ({"max_cpu_millis": 4 * 1000}, "max_cpu_millis"),
        ({"max_memory_mib": 4 * 512}, "max_memory_mib"),
    ],
)
def test_the_quota_is_decided_for_the_k_together(make_tenant, limits, limit_name):
    """The parent (live, 1000m, 512 MiB) and 3 children fill a limit of 4: a fork of 3
    fits, a fork of 4 is refused whole, naming the limit and today's use."""
    tenant, _ = make_tenant()
    snap = _ready_snapshot(tenant, cpu_millis=1000, memory_mib=512)
    _limit(tenant, **limits)
    with pytest.raises(ApiError) as refused:
        snapshot_fork(tenant=tenant, snapshot=snap, count=4, idempotency_key=None, actor="t")
    assert refused.value.status_code == 429 and refused.value.code == "quota_exceeded"
    assert refused.value.extra["limit"] == limit_name
    in_use = {"max_concurrent_sandboxes": 1, "max_cpu_millis": 1000, "max_memory_mib": 512}
    assert refused.value.extra["current"] == in_use[limit_name]
    assert Sandbox.objects.filter(snapshot=snap).count() == 0  # not one of them
    assert SandboxEvent.objects.filter(tenant_id=tenant.pk, event="created").count() == 0
    children, created = snapshot_fork(
        tenant=tenant, snapshot=snap, count=3, idempotency_key=None, actor="t"
    )
    assert created and len(children) == 3
    with pytest.raises(ApiError):  # now full: not even one more
        snapshot_fork(tenant=tenant, snapshot=snap, count=1, idempotency_key=None, actor="t")


def test_a_fork_that_loses_the_race_for_its_key_returns_the_winners_children(make_tenant):
    """The key was free when looked up, taken by the time of the insert (a concurrent
    retry of the same fork): the loser rolls back whole and answers with the winner's K."""
    tenant, _ = make_tenant()
    snap = _ready_snapshot(tenant)
    winner, _ = snapshot_fork(
        tenant=tenant, snapshot=snap, count=3, idempotency_key="k3", actor="t"
    )
    real = snapshot_services._fork_replayed
    calls: list[int] = []

    def first_lookup_misses(**kwargs: Any) -> Any:
        calls.append(1)
        return None if len(calls) == 1 else real(**kwargs)

    with mock.patch.object(snapshot_services, "_fork_replayed", side_effect=first_lookup_misses):
        loser, created = snapshot_fork(
            tenant=tenant, snapshot=snap, count=3, idempotency_key="k3", actor="t"
        )
    assert len(calls) == 2  # the insert did conflict, and the replay answered
    assert not created and [c.pk for c in loser] == [c.pk for c in winner]
    assert Sandbox.objects.filter(snapshot=snap).count() == 3


def test_the_children_are_enqueued_in_shares_after_commit(
    make_tenant, settings, django_capture_on_commit_callbacks
):
    from apps.sandboxes import tasks

    settings.HEDGEROW_FORK_TASKS = 3
    tenant, _ = make_tenant()
    snap = _ready_snapshot(tenant)
    sent: list[list[str]] = []
    with mock.patch.object(tasks.provision_sandboxes, "delay", side_effect=sent.append):
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            children, _ = snapshot_fork(
                tenant=tenant, snapshot=snap, count=8, idempotency_key=None, actor="t"
            )
        assert sent == []  # nothing before the commit
        for callback in callbacks:
            callback()
    assert len(sent) == 3  # three shares, not eight tasks
    assert sorted(i for share in sent for i in share) == sorted(str(c.id) for c in children)
    assert sorted(len(share) for share in sent) == [2, 3, 3]


def test_one_childs_unexpected_error_does_not_stop_its_share(monkeypatch):
    """``provision_sandboxes`` runs a share on threads; an error that escapes one
    child's own handling is logged and the rest of the share still runs."""
    ran: list[str] = []
    threads: set[str] = set()
    lock = threading.Lock()

    def provision(*, sandbox_id: str) -> None:
        with lock:
            ran.append(sandbox_id)
            threads.add(threading.current_thread().name)
        if sandbox_id == "c2":
            raise RuntimeError("database went away")

    monkeypatch.setattr(provisioning, "sandbox_provision", provision)
    ids = [f"c{i}" for i in range(7)]
    provisioning.sandbox_provision_many(sandbox_ids=ids, threads=3)
    assert sorted(ran) == sorted(ids)
    assert threads and all(t.startswith("provision") for t in threads)  # not this thread
    assert connection.connection is None or connection.is_usable()  # this thread's is kept


def test_a_state_publish_that_breaks_never_fails_the_transition(make_tenant, monkeypatch):
    """Seen in a fork's provisioning threads under load: redis-py surfaced a reset
    connection as a ValueError, which escaped the publish (only RedisError was caught)
    and left a claimed child in ``provisioning`` until the reaper's deadline."""
    from apps.sandboxes import events
    from apps.sandboxes.services.lifecycle import sandbox_transition

    class Broken:
        def publish(self, *args: Any) -> None:
            raise ValueError("I/O operation on closed file.")

        def pipeline(self, **kwargs: Any) -> Broken:
            return self

        def zcount(self, *args: Any) -> None:
            return None

        def execute(self) -> None:
            self.publish()

    monkeypatch.setattr(events, "redis_client", Broken)
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED)
    moved = sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED,),
        to_state=State.PROVISIONING,
        reason="scheduled",
    )
    assert moved
    sandbox.refresh_from_db()
    assert sandbox.state == State.PROVISIONING


def test_the_audit_balances_a_batched_fork(make_tenant):
    """The K rows of one insert each have their ledger row: the audit counts them
    created and live, with no row missing its ``created`` event or disagreeing with
    its ledger."""
    from apps.sandboxes.services.audit import AuditSlice, audit_compute

    tenant, _ = make_tenant()
    # the parent predates the audited period (the factory writes no ledger for it)
    snap = _ready_snapshot(tenant, created_at=timezone.now() - timedelta(days=2))
    start = timezone.now() - timedelta(minutes=1)
    snapshot_fork(tenant=tenant, snapshot=snap, count=4, idempotency_key=None, actor="t")
    report = audit_compute(
        period_start=start,
        period_end=timezone.now() + timedelta(minutes=1),
        audit_slice=AuditSlice(tenant=tenant),
    )
    assert report.created == 4 and report.terms["live"] == 4, report.equation()
    assert not any(report.imbalance.values()), report.imbalance
    assert report.balanced and report.terms["leaked"] == 0
