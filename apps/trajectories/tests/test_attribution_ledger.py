"""Issue 22 items 2–5 and 7: the decision procedure read against the ledger's order.

The lifecycle ledger and operation rows are written here as the control plane writes
them (the live tests in test_attribution_live.py cause the faults for real)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.sandboxes.models import Operation, OperationStatus, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode, EpisodeReattribution
from apps.trajectories.selectors import episode_list, episode_stats
from apps.trajectories.services.episodes import episodes_reattribute_recent

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


def _record(episode_id: str, sandbox_id: str, cls: str, started, ended, **extra) -> bytes:
    record = {
        "schema": "hedgerow.episode/v1", "episode_id": episode_id, "task_id": "imp",
        "status": "closed", "started_at": started.isoformat(), "ended_at": ended.isoformat(),
        "failure": {"auto_class": cls, "class": cls, "evidence": []},
        "sandboxes": [{"sandbox_id": sandbox_id, "generation": 1,
                       "attached_at": started.isoformat()}],
        **extra,
    }  # fmt: skip
    return (json.dumps(record) + "\n").encode()


def test_an_import_is_checked_against_this_tenants_ledger_and_keeps_its_claim(
    make_tenant, api_client, make_user, client
):
    tenant, secret = make_tenant()
    outsider, _ = make_tenant()
    client = api_client(secret)
    now = timezone.now()
    start, end = now - timedelta(seconds=50), now - timedelta(seconds=10)
    lost = _ready_sandbox(tenant, seconds_ago=100)
    _event(lost, "lost", "backend_resource_gone", now - timedelta(seconds=30))
    healthy = _ready_sandbox(tenant, seconds_ago=100)
    theirs = make_sandbox(outsider, external_id="sb-theirs")
    _event(theirs, "lost", "backend_resource_gone", now - timedelta(seconds=30))
    body = b"".join(
        [
            _record("ep-claims-success", lost.external_id, "success", start, end,
                    verifier={"outcome": "pass"}),
            _record("ep-claims-env", healthy.external_id, "environment", start, end,
                    verifier={"outcome": "fail"}),
            _record("ep-elsewhere", "sb-theirs", "success", start, end,
                    verifier={"outcome": "pass"}),
        ]
    )  # fmt: skip
    response = client.generic(
        "POST", "/api/v1/episodes/import", body, content_type="application/x-ndjson"
    )
    assert response.status_code == 200, response.content
    got = {
        e["id"]: (e["claimed_class"], e["failure_class"])
        for e in client.get("/api/v1/episodes").json()["results"]
    }
    assert got == {
        "ep-claims-success": ("success", "environment"),
        "ep-claims-env": ("environment", "task"),
        # Another tenant's sandbox of that name is not this ledger's to judge.
        "ep-elsewhere": ("success", "success"),
    }
    row = Episode.objects.get(tenant=tenant, episode_id="ep-claims-success")
    assert row.failure_evidence[0]["rule"] == "infra_fault_during_episode"
    assert "the import claimed success" in row.failure_evidence[-1]["detail"]
    assert not row.sandbox_links.filter(sandbox=theirs).exists()
    exported = client.get("/api/v1/episodes/export", {"task": "imp"})
    lines = [json.loads(x) for x in b"".join(exported.streaming_content).splitlines()]
    claims = {x["episode_id"]: x["failure"].get("claimed") for x in lines}
    assert claims == {
        "ep-claims-success": "success",
        "ep-claims-env": "environment",
        "ep-elsewhere": None,
    }
    # The pages show the disagreement: the list marks it, the episode says both.
    client.force_login(make_user("ann", (tenant, "owner")))
    listing = client.get("/trajectories/").content.decode()
    assert 'data-claimed="success"' in listing and 'data-claimed="environment"' in listing
    page = client.get("/trajectories/ep-claims-success/").content.decode()
    assert 'id="claim"' in page and "claimed" in page


def test_a_loss_noticed_in_the_grace_is_attributed_without_a_manual_call(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    crashed_on = _ready_sandbox(tenant)
    crashed = _open(client, sandbox_ids=[crashed_on.external_id])
    assert _close(client, crashed, termination_reason="harness_crash")["failure_class"] == (
        "undetermined"
    )
    verified_on = _ready_sandbox(tenant)
    verified = _open(client, sandbox_ids=[verified_on.external_id])
    _op(verified_on, "op-v", at=timezone.now(), exit_code=0)
    _steps(client, verified, {"kind": "verifier", "sandbox_id": verified_on.external_id,
                              "operation_id": "op-v"})  # fmt: skip
    assert _close(client, verified)["failure_class"] == "success"
    later = timezone.now() + timedelta(seconds=3)
    for sandbox in (crashed_on, verified_on):
        _event(sandbox, "lost", "backend_resource_gone", later)
    assert episodes_reattribute_recent() == 1
    classes = {
        e["id"]: e["failure_class"] for e in client.get("/api/v1/episodes").json()["results"]
    }
    assert classes == {crashed["id"]: "environment", verified["id"]: "success"}
    # the move is recorded with the ledger fact that caused it
    moved = EpisodeReattribution.objects.get(episode__episode_id=crashed["id"])
    assert (moved.from_class, moved.to_class, moved.cause) == (
        "undetermined",
        "environment",
        "ledger_changed_in_grace",
    )
    assert moved.evidence[0]["source"] == "ledger"
    assert moved.evidence[0]["reason"] == "backend_resource_gone"
    assert not EpisodeReattribution.objects.filter(episode__episode_id=verified["id"]).exists()
    assert episodes_reattribute_recent() == 0  # idempotent: nothing more to move or record
    assert EpisodeReattribution.objects.count() == 1
    # Past the grace nothing is re-run, whatever the ledger says now.
    Episode.objects.filter(episode_id=verified["id"]).update(auto_failure_class="task")
    assert episodes_reattribute_recent(now=timezone.now() + timedelta(hours=1)) == 0
