"""Issue 22 items 2–5 and 7: the decision procedure read against the ledger's order.

The lifecycle ledger and operation rows are written here as the control plane writes
them (the live tests in test_attribution_live.py cause the faults for real)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.sandboxes.models import Operation, OperationStatus, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode
from apps.trajectories.selectors import episode_list, episode_stats

pytestmark = pytest.mark.django_db


def _ready_sandbox(tenant, seconds_ago: float = 60):
    ready_at = timezone.now() - timedelta(seconds=seconds_ago)
    sandbox = make_sandbox(tenant, ready_at=ready_at)
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=tenant, event="transition", from_state="provisioning",
        to_state="ready", reason="agent_healthy", generation=1, at=ready_at,
    )  # fmt: skip
    return sandbox


def _event(sandbox, to_state: str, reason: str, at, *, actor: str = "", frm: str = "ready"):
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=sandbox.tenant, event="transition", from_state=frm,
        to_state=to_state, reason=reason, actor=actor, generation=1, at=at,
    )  # fmt: skip


def _op(sandbox, op_id: str, *, at, exit_code: int | None = 1, **fields):
    values = {
        "status": OperationStatus.COMPLETED, "termination": "exited", "exit_code": exit_code,
        "finished_at": at + timedelta(milliseconds=200),
    }  # fmt: skip
    values.update(fields)
    return Operation.objects.create(
        tenant=sandbox.tenant, sandbox=sandbox, operation_id=op_id, generation=1,
        request={"command": "verify"}, request_hash="h", created_at=at, **values,
    )  # fmt: skip


def _open(client, **body):
    response = client.post("/api/v1/episodes", {"task_id": "t-1", **body}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def _steps(client, ep, *steps):
    response = client.post(f"/api/v1/episodes/{ep['id']}/steps", {"steps": list(steps)}, "json")
    assert response.status_code == 201, response.content


def _close(client, ep, **body):
    response = client.post(f"/api/v1/episodes/{ep['id']}/close", body, format="json")
    assert response.status_code == 200, response.content
    return response.json()


def test_a_sandbox_deleted_by_another_client_inside_the_window_is_environment(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = _ready_sandbox(tenant)
    ep = _open(client, sandbox_ids=[sandbox.external_id])
    _event(sandbox, "terminating", "deleted", timezone.now(), actor="key:someone-else")
    # The harness saw its exec refused and scored the episode 0: still not the policy.
    closed = _close(client, ep, reward=0.0, termination_reason="sandbox_lost")
    assert closed["failure_class"] == "environment"
    fact = closed["failure_evidence"][1]
    assert (fact["source"], fact["reason"]) == ("ledger", "deleted")
    assert "key:someone-else" in fact["detail"]
    # Counter-case: the harness deleting its sandbox after the episode ended is cleanup.
    other = _ready_sandbox(tenant)
    done = _open(client, sandbox_ids=[other.external_id])
    closed = _close(client, done, reward=0.0)
    _event(other, "terminating", "deleted", timezone.now() + timedelta(seconds=1))
    again = client.post(f"/api/v1/episodes/{done['id']}/attribute").json()
    assert (closed["failure_class"], again["failure_class"]) == ("task", "task")


def test_a_verdict_reached_while_healthy_stands_after_a_later_loss(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = _ready_sandbox(tenant)
    verdicts = {}
    for name, exit_code in (("passed", 0), ("failed", 1)):
        ep = _open(client, sandbox_ids=[sandbox.external_id])
        _op(sandbox, f"op-{name}", at=timezone.now(), exit_code=exit_code)
        _steps(client, ep, {"kind": "verifier", "sandbox_id": sandbox.external_id,
                            "operation_id": f"op-{name}"})  # fmt: skip
        verdicts[name] = (ep, _close(client, ep)["failure_class"])
    # The sandbox is lost after both closed, noticed inside the detection grace.
    _event(sandbox, "lost", "backend_resource_gone", timezone.now() + timedelta(seconds=2))
    for name, (ep, before) in verdicts.items():
        after = client.post(f"/api/v1/episodes/{ep['id']}/attribute").json()
        assert (name, before, after["failure_class"]) == (
            name,
            {"passed": "success", "failed": "task"}[name],
            before,
        )
        assert any("after the verdict" in f["detail"] for f in after["failure_evidence"][1:])
    # Counter-case: no verdict (the harness crashed as the sandbox went): the loss the
    # watcher noticed just after the end is still the episode's environment failure.
    other = _ready_sandbox(tenant)
    crashed = _open(client, sandbox_ids=[other.external_id])
    _close(client, crashed, termination_reason="harness_crash")
    _event(other, "lost", "backend_resource_gone", timezone.now() + timedelta(seconds=2))
    late = client.post(f"/api/v1/episodes/{crashed['id']}/attribute").json()
    assert late["failure_class"] == "environment"


def test_a_late_ready_does_not_clear_startup(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = make_sandbox(tenant, state=State.PROVISIONING, generation=1)
    ep = _open(client, sandbox_ids=[sandbox.external_id])
    closed = _close(client, ep, termination_reason="harness_crash")
    assert closed["failure_class"] == "startup"
    ready_at = timezone.now() + timedelta(seconds=1)
    _event(sandbox, "ready", "agent_healthy", ready_at, frm="provisioning")
    type(sandbox).objects.filter(pk=sandbox.pk).update(state=State.READY, ready_at=ready_at)
    again = client.post(f"/api/v1/episodes/{ep['id']}/attribute").json()
    assert again["failure_class"] == "startup"
    assert "not ready by the episode's end" in again["failure_evidence"][1]["detail"]


def test_impossible_windows_are_refused_and_the_ledger_order_beats_the_clients_clock(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    future = (timezone.now() + timedelta(hours=1)).isoformat()
    ahead = client.post("/api/v1/episodes", {"task_id": "t", "started_at": future}, "json")
    assert ahead.status_code == 400
    assert ahead.json()["error"]["code"] == "invalid_window"
    assert ahead.json()["error"]["field"] == "started_at"
    assert not Episode.objects.filter(tenant=tenant).exists()

    ep = _open(client)
    before = (timezone.now() - timedelta(hours=1)).isoformat()
    for ended_at, why in ((before, "before"), (future, "after the server")):
        refused = client.post(f"/api/v1/episodes/{ep['id']}/close", {"ended_at": ended_at}, "json")
        assert refused.status_code == 400, refused.content
        assert (refused.json()["error"]["code"], refused.json()["error"]["field"]) == (
            "invalid_window",
            "ended_at",
        )
        assert why in refused.json()["error"]["message"]
    assert Episode.objects.get(episode_id=ep["id"]).status == "open"

    # A client clock ahead of the server's: its started_at is after the operation the
    # episode ran. The linked failed operation is still inside the episode.
    sandbox = _ready_sandbox(tenant, seconds_ago=120)
    skewed = _open(client, sandbox_ids=[sandbox.external_id],
                   started_at=timezone.now().isoformat())  # fmt: skip
    _op(sandbox, "op-early", at=timezone.now() - timedelta(seconds=30), exit_code=None,
        status=OperationStatus.FAILED, termination="agent_error",
        error={"code": "agent_unreachable", "message": "refused"})  # fmt: skip
    _steps(client, skewed, {"kind": "exec", "sandbox_id": sandbox.external_id,
                            "operation_id": "op-early"})  # fmt: skip
    closed = _close(client, skewed, reward=0.0)
    assert closed["failure_class"] == "environment"
    assert closed["failure_evidence"][1]["operation_id"] == "op-early"


def test_eta_counts_an_episode_without_a_verdict_as_not_usable(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    solved = _close(client, _open(client, task_id="a"), verifier_outcome="pass")
    crashed = _close(client, _open(client, task_id="a"), termination_reason="harness_crash")
    assert crashed["failure_class"] == "undetermined"
    assert (solved["valid"], crashed["valid"]) == (True, False)
    stats = episode_stats(episodes=episode_list(tenant=tenant))
    assert (stats.episodes, stats.valid, stats.eta) == (2, 1, 0.5)
    assert stats.success_rate_valid == 1.0
