"""Reapers remove what nobody deletes, each removal naming its reason in the ledger."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services import provisioning
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


@pytest.fixture
def destroyed(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(
        "apps.sandboxes.tasks.destroy_sandbox.delay", lambda sandbox_id: calls.append(sandbox_id)
    )
    return calls


def _last_transition(sandbox):
    return SandboxEvent.objects.filter(sandbox=sandbox, event="transition").last()


def test_it_reaps_a_sandbox_past_its_ttl(make_tenant, destroyed):
    tenant, _ = make_tenant()
    now = timezone.now()
    expired = make_sandbox(tenant, expires_at=now - timedelta(seconds=1))
    fresh = make_sandbox(tenant, expires_at=now + timedelta(hours=1))
    counts = provisioning.sandbox_reap(now=now)
    assert counts["ttl_expired"] == 1
    expired.refresh_from_db()
    fresh.refresh_from_db()
    assert (expired.state, fresh.state) == (State.TERMINATING, State.READY)
    event = _last_transition(expired)
    assert (event.reason, event.actor) == ("ttl_expired", "reaper")
    assert destroyed == [str(expired.id)]


def test_it_reaps_a_sandbox_whose_heartbeats_stopped(make_tenant, destroyed):
    tenant, _ = make_tenant()
    now = timezone.now()
    silent = make_sandbox(
        tenant, heartbeat_timeout_s=30, last_heartbeat_at=now - timedelta(seconds=31)
    )
    beating = make_sandbox(
        tenant, heartbeat_timeout_s=30, last_heartbeat_at=now - timedelta(seconds=5)
    )
    no_heartbeat_required = make_sandbox(tenant, last_heartbeat_at=now - timedelta(days=1))
    counts = provisioning.sandbox_reap(now=now)
    assert counts["heartbeat_expired"] == 1
    for sandbox in (silent, beating, no_heartbeat_required):
        sandbox.refresh_from_db()
    assert silent.state == State.TERMINATING
    assert beating.state == no_heartbeat_required.state == State.READY
    assert _last_transition(silent).reason == "heartbeat_expired"
    assert destroyed == [str(silent.id)]


def test_it_fails_a_sandbox_stuck_pending(make_tenant, destroyed, settings):
    tenant, _ = make_tenant()
    now = timezone.now()
    stuck = make_sandbox(
        tenant,
        state=State.PROVISIONING,
        created_at=now - timedelta(seconds=settings.HEDGEROW_PENDING_TIMEOUT_S + 1),
    )
    young = make_sandbox(tenant, state=State.REQUESTED, created_at=now)
    counts = provisioning.sandbox_reap(now=now)
    assert counts["pending_timeout"] == 1
    stuck.refresh_from_db()
    young.refresh_from_db()
    assert (stuck.state, young.state) == (State.FAILED, State.REQUESTED)
    assert _last_transition(stuck).reason == "pending_timeout"
    assert stuck.status_message
    assert destroyed == [str(stuck.id)]


def test_it_keeps_a_sandbox_alive_with_heartbeats(make_tenant, api_client, destroyed):
    tenant, secret = make_tenant()
    old = timezone.now() - timedelta(seconds=25)
    sandbox = make_sandbox(tenant, heartbeat_timeout_s=30, last_heartbeat_at=old)
    response = api_client(secret).post(f"/api/v1/sandboxes/{sandbox.external_id}/heartbeat")
    assert response.status_code == 200
    sandbox.refresh_from_db()
    assert sandbox.last_heartbeat_at is not None and sandbox.last_heartbeat_at > old
    provisioning.sandbox_reap(now=timezone.now() + timedelta(seconds=10))
    sandbox.refresh_from_db()
    assert sandbox.state == State.READY


def test_it_is_safe_when_two_reapers_race(make_tenant, destroyed):
    tenant, _ = make_tenant()
    now = timezone.now()
    make_sandbox(tenant, expires_at=now - timedelta(seconds=1))
    first = provisioning.sandbox_reap(now=now)
    second = provisioning.sandbox_reap(now=now)
    assert (first["ttl_expired"], second["ttl_expired"]) == (1, 0)
    assert len(destroyed) == 1


def test_the_heartbeat_reaper_goes_by_the_real_deadline_not_the_due_time(make_tenant, destroyed):
    """``heartbeat_due_at`` only says when to look: a row found early is kept and its due
    time moved up to the real deadline, where it is then reaped."""
    tenant, _ = make_tenant()
    now = timezone.now()
    early = make_sandbox(
        tenant,
        heartbeat_timeout_s=30,
        last_heartbeat_at=now - timedelta(seconds=20),
        heartbeat_due_at=now - timedelta(seconds=25),
    )
    assert provisioning.sandbox_reap(now=now)["heartbeat_expired"] == 0
    early.refresh_from_db()
    assert early.state == State.READY
    assert early.heartbeat_due_at == now + timedelta(seconds=10)
    assert provisioning.sandbox_reap(now=now + timedelta(seconds=10))["heartbeat_expired"] == 0
    assert provisioning.sandbox_reap(now=now + timedelta(seconds=11))["heartbeat_expired"] == 1
    early.refresh_from_db()
    assert early.state == State.TERMINATING
    assert destroyed == [str(early.id)]


def _beat_and_due(client, url, sandbox):
    """Heartbeats through the API; (last_heartbeat_at, heartbeat_due_at) after it."""
    assert client.post(url).status_code == 200
    sandbox.refresh_from_db()
    last, due = sandbox.last_heartbeat_at, sandbox.heartbeat_due_at
    assert last is not None and due is not None
    return last, due


def test_a_heartbeat_moves_the_due_time_only_near_it(make_tenant, api_client, destroyed):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, heartbeat_timeout_s=30, last_heartbeat_at=timezone.now())
    client = api_client(secret)
    url = f"/api/v1/sandboxes/{sandbox.external_id}/heartbeat"
    first, first_due = _beat_and_due(client, url, sandbox)
    assert first_due == first + timedelta(seconds=30)
    # more than half a timeout away: the next heartbeat leaves the indexed column alone
    second, second_due = _beat_and_due(client, url, sandbox)
    assert second > first and second_due == first_due
    # within half a timeout of it: the heartbeat moves it to its own deadline
    Sandbox.objects.filter(pk=sandbox.pk).update(
        heartbeat_due_at=timezone.now() + timedelta(seconds=14)
    )
    last, due = _beat_and_due(client, url, sandbox)
    assert due == last + timedelta(seconds=30)
    # and the reaper still goes by the real deadline
    assert provisioning.sandbox_reap(now=last + timedelta(seconds=30))["heartbeat_expired"] == 0
    assert provisioning.sandbox_reap(now=last + timedelta(seconds=31))["heartbeat_expired"] == 1
