"""The admission queue: FIFO within a tenant, round-robin across tenants."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.core.errors import ApiError
from apps.sandboxes.admission.queue import (
    admission_queue_drain,
    admission_queue_expire,
    queue_order,
    queue_position,
)
from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_transition

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit enqueues must run


def _create(tenant, name, queue=True):
    sandbox, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(
            image="host", cpu_millis=500, memory_mib=256, external_id=name, queue=queue
        ),
        idempotency_key=None,
        actor="key:test",
    )
    return sandbox


def _end(sandbox):
    assert sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED, State.PROVISIONING, State.READY),
        to_state=State.DELETED,
        reason="destroyed",
        terminated_at=timezone.now(),
    )


def _admitted_order():
    return list(
        SandboxEvent.objects.filter(reason="admitted", to_state=State.REQUESTED)
        .order_by("at", "id")
        .values_list("sandbox__external_id", flat=True)
    )


@override_settings(HEDGEROW_MAX_LIVE_SANDBOXES=2)
def test_it_admits_in_order_and_round_robin_across_tenants(make_tenant, no_enqueue):
    a, _ = make_tenant()
    b, _ = make_tenant()
    running = [_create(a, "run-1"), _create(a, "run-2")]
    assert [s.state for s in running] == [State.REQUESTED, State.REQUESTED]
    for name in ("a1", "a2", "a3", "a4"):
        assert _create(a, name).state == State.QUEUED
    for name in ("b1", "b2"):
        assert _create(b, name).state == State.QUEUED
    assert len(no_enqueue["provision"]) == 2  # queued sandboxes are not provisioned
    order = [Sandbox.objects.get(pk=pk).external_id for pk, _ in queue_order()]
    assert order == ["a1", "b1", "a2", "b2", "a3", "a4"]
    b2 = Sandbox.objects.get(external_id="b2")
    assert queue_position(sandbox=b2) == 4

    _end(running[0])
    assert no_enqueue["drain"], "a sandbox's end must trigger a drain after commit"
    assert admission_queue_drain() == 1
    assert _admitted_order() == ["a1"]
    _end(running[1])
    assert admission_queue_drain() == 1
    assert _admitted_order() == ["a1", "b1"]
    for sandbox in Sandbox.objects.filter(external_id__in=["a1", "b1"]):
        _end(sandbox)
    assert admission_queue_drain() == 2
    assert _admitted_order() == ["a1", "b1", "a2", "b2"]
    a2 = Sandbox.objects.get(external_id="a2")
    assert a2.admitted_at is not None and a2.expires_at > a2.admitted_at
    assert a2.last_heartbeat_at == a2.admitted_at  # the heartbeat clock starts now too
    assert len(no_enqueue["provision"]) == 6
    assert queue_position(sandbox=Sandbox.objects.get(external_id="a4")) == 2
    assert queue_position(sandbox=a2) is None


def test_it_skips_a_tenant_at_its_own_limit_without_blocking_others(make_tenant, no_enqueue):
    a, _ = make_tenant()
    b, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=a).pk).update(max_concurrent_sandboxes=1)
    TenantQuota.objects.filter(pk=quota_get(tenant=b).pk).update(
        max_concurrent_sandboxes=1, queue_by_default=True
    )
    first_a, first_b = _create(a, "a0"), _create(b, "b0", queue=None)
    assert (first_a.state, first_b.state) == (State.REQUESTED, State.REQUESTED)
    assert _create(a, "a1").state == State.QUEUED
    assert _create(b, "b1", queue=None).state == State.QUEUED  # the team's default
    with pytest.raises(ApiError) as refused:
        _create(a, "a2", queue=False)
    assert refused.value.status_code == 429
    _end(first_b)
    assert admission_queue_drain() == 1  # a is still full; b's next goes
    assert _admitted_order() == ["b1"]
    assert Sandbox.objects.get(external_id="a1").state == State.QUEUED


def test_it_keeps_a_tenants_queue_fifo_even_when_capacity_is_free(make_tenant, no_enqueue):
    a, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=a).pk).update(max_concurrent_sandboxes=1)
    running = _create(a, "a0")
    assert _create(a, "a1").state == State.QUEUED
    _end(running)
    # Capacity is free but a1 is still waiting: a new queued create goes behind it.
    assert _create(a, "a2").state == State.QUEUED
    assert admission_queue_drain() == 1
    assert _admitted_order() == ["a1"]


def test_it_refuses_to_queue_past_the_queue_limit_and_expires_old_entries(make_tenant, no_enqueue):
    a, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=a).pk).update(
        max_concurrent_sandboxes=0, max_queued=2
    )
    _create(a, "q1"), _create(a, "q2")
    with pytest.raises(ApiError) as full:
        _create(a, "q3")
    assert full.value.extra == {"limit": "max_queued", "value": 2, "current": 2}
    Sandbox.objects.filter(external_id="q1").update(created_at=timezone.now() - timedelta(days=1))
    assert admission_queue_expire() == 1
    q1 = Sandbox.objects.get(external_id="q1")
    assert q1.state == State.FAILED
    last = q1.events.last()
    assert last is not None and last.reason == "queue_timeout"


def test_it_deletes_a_queued_sandbox_without_ever_provisioning_it(make_tenant, no_enqueue):
    from apps.sandboxes.services.lifecycle import sandbox_delete

    a, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=a).pk).update(max_concurrent_sandboxes=0)
    queued = _create(a, "q1")
    sandbox_delete(sandbox=queued, actor="key:test")
    queued.refresh_from_db()
    assert queued.state == State.TERMINATING
    assert no_enqueue["provision"] == [] and len(no_enqueue["destroy"]) == 1
    assert admission_queue_drain() == 0


def test_it_fails_a_queued_sandbox_whose_team_spent_its_budget_meanwhile(
    make_tenant, no_enqueue, seeded_price_books
):
    from decimal import Decimal

    from apps.billing.tests.test_costs import ledger_sandbox

    a, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=a).pk).update(
        max_concurrent_sandboxes=1, monthly_budget=Decimal("1.00")
    )
    running = _create(a, "a0")
    waiting = _create(a, "a1")
    assert waiting.state == State.QUEUED
    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    ledger_sandbox(
        a, start, [("provisioning", 0), ("deleted", 4 * 3600)], cpu_millis=8000, memory_mib=32
    )  # $1.28 this month
    _end(running)
    assert admission_queue_drain() == 0
    waiting.refresh_from_db()
    assert waiting.state == State.FAILED
    last = waiting.events.last()
    assert last is not None and last.reason == "budget_exhausted"
    assert no_enqueue["provision"] == [(str(running.pk),)]


def test_it_enqueues_no_drain_when_a_sandbox_ends_with_nothing_queued(make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    running = _create(tenant, "run-1", queue=False)
    _end(running)
    assert no_enqueue["drain"] == []  # nothing to admit: no task
    assert Sandbox.objects.get(pk=running.pk).state == State.DELETED
