"""The episode API without live sandboxes: steps, closing, relabeling, numbers, tenancy."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from apps.sandboxes.models import Operation, OperationStatus, SandboxEvent
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode, EpisodeRelabel, Step
from apps.trajectories.selectors import episode_list, episode_stats
from apps.trajectories.services.episodes import EpisodeResult, episode_close, episode_open

pytestmark = pytest.mark.django_db


def _open(client, **body):
    response = client.post("/api/v1/episodes", {"task_id": "t-1", **body}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_it_opens_appends_and_closes_an_episode_with_a_verdict(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    ep = _open(client, model="m-1", harness="h", sampling={"temperature": 0.7})
    steps = client.post(
        f"/api/v1/episodes/{ep['id']}/steps",
        {
            "steps": [
                {"kind": "model", "action": "ls", "model_call": {"tokens_in": 10, "tokens_out": 2}},
                {"kind": "tool", "action": {"tool": "search"}, "observation": {"text": "x"}},
            ]
        },
        format="json",
    )
    assert steps.status_code == 201, steps.content
    assert [s["index"] for s in steps.json()["results"]] == [0, 1]
    closed = client.post(
        f"/api/v1/episodes/{ep['id']}/close",
        {"termination_reason": "submitted", "verifier_outcome": "pass", "reward": 1.0},
        format="json",
    )
    assert closed.status_code == 200, closed.content
    body = closed.json()
    assert (body["status"], body["failure_class"], body["auto_failure_class"]) == (
        "closed",
        "success",
        "success",
    )
    assert body["resources"]["tokens_in"] == 10
    row = Episode.objects.get(episode_id=ep["id"])
    assert row.sampling == {"temperature": 0.7} and row.steps.count() == 2
    late = client.post(
        f"/api/v1/episodes/{ep['id']}/steps", {"steps": [{"kind": "model"}]}, format="json"
    )
    assert late.status_code == 409
    assert late.json()["error"]["code"] == "episode_closed"
    assert Step.objects.filter(episode=row).count() == 2


def test_it_keeps_the_episode_open_call_idempotent_by_episode_id(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    first = _open(client, episode_id="ep-fixed", attempt_id="a1")
    again = client.post(
        "/api/v1/episodes",
        {"task_id": "t-1", "episode_id": "ep-fixed", "attempt_id": "a1"},
        format="json",
    )
    assert again.status_code == 200 and again.json()["id"] == first["id"]
    other = client.post(
        "/api/v1/episodes",
        {"task_id": "t-2", "episode_id": "ep-fixed", "attempt_id": "a1"},
        format="json",
    )
    assert other.status_code == 409
    assert Episode.objects.filter(episode_id="ep-fixed").count() == 1


def test_it_ignores_a_client_claim_of_sandbox_loss_the_ledger_does_not_show(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = make_sandbox(tenant)
    ep = _open(client, sandbox_ids=[sandbox.external_id])
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=tenant, event="transition", from_state="provisioning",
        to_state="ready", reason="agent_healthy", generation=1,
        at=timezone.now() - timedelta(seconds=5),
    )  # fmt: skip
    closed = client.post(
        f"/api/v1/episodes/{ep['id']}/close",
        {"termination_reason": "sandbox_lost", "verifier_outcome": "fail"},
        format="json",
    ).json()
    assert closed["failure_class"] == "task"
    assert any("no loss" in fact["detail"] for fact in closed["failure_evidence"][1:])


def test_it_attributes_a_failed_operation_of_the_episodes_sandbox_to_environment(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = make_sandbox(tenant)
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=tenant, event="transition", to_state="ready", generation=1,
        at=timezone.now() - timedelta(seconds=5),
    )  # fmt: skip
    ep = _open(client, sandbox_ids=[sandbox.external_id])
    Operation.objects.create(
        tenant=tenant, sandbox=sandbox, operation_id="op-x", generation=1, request={},
        request_hash="h", status=OperationStatus.FAILED, termination="agent_error",
        error={"code": "agent_unreachable", "message": "refused"},
    )  # fmt: skip
    appended = client.post(
        f"/api/v1/episodes/{ep['id']}/steps",
        {"steps": [{"kind": "exec", "sandbox_id": sandbox.external_id, "operation_id": "op-x"}]},
        format="json",
    )
    assert appended.status_code == 201, appended.content
    assert appended.json()["results"][0]["observation"]["error"]["code"] == "agent_unreachable"
    closed = client.post(
        f"/api/v1/episodes/{ep['id']}/close", {"verifier_outcome": "pass"}, format="json"
    ).json()
    assert closed["failure_class"] == "environment"
    assert closed["failure_evidence"][1]["source"] == "operation"


def test_it_relabels_with_a_reason_and_keeps_the_automatic_label_and_trail(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    ep = _open(client)
    open_relabel = client.post(
        f"/api/v1/episodes/{ep['id']}/relabel",
        {"failure_class": "task", "reason": "x"},
        format="json",
    )
    assert open_relabel.status_code == 409
    client.post(f"/api/v1/episodes/{ep['id']}/close", {"verifier_outcome": "fail"}, format="json")
    no_reason = client.post(
        f"/api/v1/episodes/{ep['id']}/relabel",
        {"failure_class": "verifier", "reason": ""},
        format="json",
    )
    assert no_reason.status_code == 400
    relabeled = client.post(
        f"/api/v1/episodes/{ep['id']}/relabel",
        {"failure_class": "verifier", "reason": "the verifier's test file was stale"},
        format="json",
    )
    assert relabeled.status_code == 200, relabeled.content
    assert (relabeled.json()["failure_class"], relabeled.json()["auto_failure_class"]) == (
        "verifier",
        "task",
    )
    client.post(
        f"/api/v1/episodes/{ep['id']}/relabel",
        {"failure_class": "task", "reason": "no: the test was fine"},
        format="json",
    )
    # Re-running attribution never overwrites a person's label.
    client.post(f"/api/v1/episodes/{ep['id']}/attribute")
    row = Episode.objects.get(episode_id=ep["id"])
    assert (row.failure_class, row.auto_failure_class) == ("task", "task")
    trail = list(EpisodeRelabel.objects.filter(episode=row).values_list("from_class", "to_class"))
    assert trail == [("task", "verifier"), ("verifier", "task")]
    listed = client.get(f"/api/v1/episodes/{ep['id']}/relabel").json()["results"]
    assert listed[0]["reason"] == "the verifier's test file was stale"
    assert listed[0]["actor"].startswith("key:")
    filtered = client.get("/api/v1/episodes", {"relabeled": "true"}).json()
    assert [e["id"] for e in filtered["results"]] == [ep["id"]]


def _closed(tenant, task: str, outcome: str = "", cost: str = "0", **result):
    episode, _ = episode_open(tenant=tenant, actor="t", fields={"task_id": task}, sandbox_ids=[])
    episode = episode_close(
        episode=episode, result=EpisodeResult(verifier_outcome=outcome, **result)
    )
    Episode.objects.filter(pk=episode.pk).update(cost=Decimal(cost))
    return episode


def test_it_computes_eta_cost_per_valid_and_success_for_a_hand_checked_set(make_tenant):
    tenant, _ = make_tenant()
    # 10 closed episodes over 3 tasks, costs summing to 2.00:
    #   A: success, success, task, verifier           (verifier: invalid)
    #   B: task, task, inference                      (inference counts as valid)
    #   C: verifier, verifier(relabeled→environment), success(relabeled→observation)
    _closed(tenant, "A", "pass", "0.20")
    _closed(tenant, "A", "pass", "0.20")
    _closed(tenant, "A", "fail", "0.20")
    _closed(tenant, "A", "timeout", "0.20")
    _closed(tenant, "B", "fail", "0.10")
    _closed(tenant, "B", "fail", "0.10")
    _closed(tenant, "B", "", "0.40", inference_error={"status": 503})
    _closed(tenant, "C", "error", "0.20")
    env = _closed(tenant, "C", "error", "0.20")
    obs = _closed(tenant, "C", "pass", "0.20")
    Episode.objects.filter(pk=env.pk).update(failure_class="environment")
    Episode.objects.filter(pk=obs.pk).update(failure_class="observation")
    episode_open(tenant=tenant, actor="t", fields={"task_id": "D"}, sandbox_ids=[])  # still open

    stats = episode_stats(episodes=episode_list(tenant=tenant))
    assert stats.episodes == 10 and stats.open_episodes == 1
    assert stats.by_class["success"] == 2 and stats.by_class["verifier"] == 2
    # invalid: A-verifier, C-verifier, C-environment, C-observation = 4 → valid 6
    assert stats.valid == 6
    assert stats.eta == pytest.approx(0.6)
    assert stats.cost == Decimal("2.00")
    # cost / (N·η) = 2.00 / (10 × 0.6) = 0.333333
    assert stats.cost_per_valid == Decimal("0.333333")
    assert stats.success_rate_raw == pytest.approx(0.2)
    assert stats.success_rate_valid == pytest.approx(2 / 6)
    # tasks, not rollouts: A solved; B valid but unsolved; C has no valid rollout; D open
    assert (stats.tasks, stats.tasks_with_valid, stats.tasks_solved) == (3, 2, 1)
    assert stats.task_success_rate == pytest.approx(0.5)
    assert stats.mean_task_success == pytest.approx((2 / 3 + 0) / 2)
    only_b = episode_stats(episodes=episode_list(tenant=tenant, filters={"task": "B"}))
    assert (only_b.episodes, only_b.valid, only_b.by_class["inference"]) == (3, 3, 1)


def test_it_gives_another_tenant_nothing(make_tenant, api_client):
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    ep = _open(api_client(secret))
    outsider = api_client(other_secret)
    for method, path in (
        ("get", f"/api/v1/episodes/{ep['id']}"),
        ("get", f"/api/v1/episodes/{ep['id']}/steps"),
        ("get", f"/api/v1/episodes/{ep['id']}/timeline"),
        ("post", f"/api/v1/episodes/{ep['id']}/steps"),
        ("post", f"/api/v1/episodes/{ep['id']}/close"),
        ("post", f"/api/v1/episodes/{ep['id']}/relabel"),
    ):
        response = getattr(outsider, method)(path, {}, format="json")
        assert response.status_code == 404, (method, path, response.content)
    assert outsider.get("/api/v1/episodes").json()["count"] == 0
    assert outsider.get("/api/v1/episodes/export").getvalue() == b""
    assert Episode.objects.get(episode_id=ep["id"]).status == "open"


def test_it_refuses_to_attach_another_tenants_sandbox(make_tenant, api_client):
    tenant, secret = make_tenant()
    other, _ = make_tenant()
    foreign = make_sandbox(other)
    response = api_client(secret).post(
        "/api/v1/episodes", {"task_id": "t", "sandbox_ids": [foreign.external_id]}, format="json"
    )
    assert response.status_code == 404
    assert not Episode.objects.filter(tenant=tenant).exists()
