"""The difficulty posterior, its decay, and broken-vs-hard, with the arithmetic by hand."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from apps.datasets.models import EpisodeContribution, TaskDifficulty
from apps.datasets.services.difficulty import decay_weights, difficulty_rebuild
from apps.datasets.tests.factories import closed_episode

pytestmark = pytest.mark.django_db


def _family(client, task, family="m-1", **params):
    response = client.get(f"/api/v1/tasks/{task}/difficulty", params)
    assert response.status_code == 200, response.content
    return response.json()["families"][family]


def test_it_counts_only_valid_verdicts_and_decays_old_versions(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    t0 = timezone.now() - timedelta(hours=2)
    for i, cls in enumerate(
        ["success", "success", "success", "task", "environment", "undetermined"]
    ):
        closed_episode(
            tenant,
            "swe-1",
            cls,
            model="m-1",
            policy_version="v1",
            started_at=t0 + timedelta(seconds=i),
        )
    # v1 only: s=3, f=1 (environment and undetermined say nothing about the task)
    # mean = (3+1)/(3+1+1+1) = 4/6
    fam = _family(client, "swe-1")
    assert (fam["successes"], fam["failures"], fam["infra"], fam["other"]) == (3, 1, 1, 1)
    assert fam["mean"] == pytest.approx(4 / 6)
    # a new policy version: old counts weigh 0.5 (the default decay)
    closed_episode(
        tenant,
        "swe-1",
        "task",
        model="m-1",
        policy_version="v2",
        started_at=t0 + timedelta(hours=1),
    )
    # s_eff = 0.5·3 + 0 = 1.5, f_eff = 0.5·1 + 1 = 1.5 → (1.5+1)/(1.5+1.5+2) = 0.5
    fam = _family(client, "swe-1")
    assert (fam["s_eff"], fam["f_eff"], fam["version"]) == (1.5, 1.5, "v2")
    assert fam["mean"] == pytest.approx(0.5)
    assert [(v["version"], v["weight"]) for v in fam["versions"]] == [("v1", 0.5), ("v2", 1.0)]
    # another prior for this call: α0=2, β0=6 → (1.5+2)/(1.5+1.5+8) = 3.5/11
    assert _family(client, "swe-1", alpha0="2", beta0="6")["mean"] == pytest.approx(3.5 / 11)
    bad = client.get("/api/v1/tasks/swe-1/difficulty", {"alpha0": "-1"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "alpha0"


def test_it_moves_a_relabeled_episode_instead_of_counting_it_twice(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    ep = closed_episode(tenant, "t", "success", model="m", policy_version="v1")
    closed_episode(tenant, "t", "task", model="m", policy_version="v1")
    assert _family(client, "t", "m")["mean"] == pytest.approx(2 / 4)
    relabel = client.post(
        f"/api/v1/episodes/{ep.episode_id}/relabel",
        {"failure_class": "task", "reason": "the test was wrong"},
        format="json",
    )
    assert relabel.status_code == 200, relabel.content
    fam = _family(client, "t", "m")
    assert (fam["successes"], fam["failures"]) == (0, 2)
    assert fam["mean"] == pytest.approx(1 / 4)  # (0+1)/(0+2+2)
    assert EpisodeContribution.objects.filter(task_id="t").count() == 2


def test_it_serves_many_tasks_in_one_call_and_hides_other_teams(make_tenant, api_client):
    tenant, secret = make_tenant()
    other, other_secret = make_tenant()
    closed_episode(tenant, "a", "success", model="m")
    closed_episode(tenant, "b", "task", model="m")
    closed_episode(other, "secret-task", "success", model="m")
    client = api_client(secret)
    body = client.get("/api/v1/tasks/difficulty", {"ids": "a,b,secret-task"}).json()
    assert body["columns"] == [
        "task_id",
        "family",
        "mean",
        "s_eff",
        "f_eff",
        "version",
        "quarantine",
    ]
    rows = {r[0]: r for r in body["rows"]}
    assert set(rows) == {"a", "b"}
    assert body["unknown"] == ["secret-task"]
    assert rows["a"][2] == pytest.approx(2 / 3) and rows["b"][2] == pytest.approx(1 / 3)
    assert rows["a"][1:2] + rows["a"][3:] == ["m", 1.0, 0.0, "unknown", False]
    # another prior: the row is built for it, (1+2)/(1+0+2+6) = 1/3
    custom = client.get("/api/v1/tasks/difficulty", {"ids": "a", "alpha0": "2", "beta0": "6"})
    assert custom.json()["rows"][0][2] == pytest.approx(3 / 9)
    posted = client.post("/api/v1/tasks/difficulty", {"ids": ["a"]}, format="json").json()
    assert [r[0] for r in posted["rows"]] == ["a"]
    every = client.get("/api/v1/tasks/difficulty").json()
    assert sorted(r[0] for r in every["rows"]) == ["a", "b"] and "unknown" not in every
    bad = client.post("/api/v1/tasks/difficulty", {"ids": "a"}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "ids"
    assert client.get("/api/v1/tasks/secret-task/difficulty").status_code == 404
    assert api_client(other_secret).get("/api/v1/tasks/a/difficulty").status_code == 404


def test_it_quarantines_a_task_whose_verifier_fails_the_reference(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    closed_episode(tenant, "broken", "task", model="m-1")
    closed_episode(tenant, "broken", "task", model="m-2")
    ok = client.post(
        "/api/v1/tasks/broken/reference-runs",
        {
            "task_version": "v1",
            "image_digest": "sha256:ab",
            "verifier_version": "3",
            "reference_outcome": "fail",
        },
        format="json",
    )
    assert ok.status_code == 201, ok.content
    body = client.get("/api/v1/tasks/broken/difficulty").json()
    assert body["quarantine"] is True and body["verifier_suspect"] is True
    rules = [fact["rule"] for fact in body["evidence"]]
    assert rules == ["verifier_fails_reference", "every_policy_fails"]
    assert body["evidence"][1]["families"] == ["m-1", "m-2"]
    bulk = client.get("/api/v1/tasks/difficulty", {"ids": "broken"}).json()
    assert {r[1]: r[6] for r in bulk["rows"]} == {"m-1": True, "m-2": True}
    assert bulk["quarantine"] == {"broken": ["verifier_fails_reference", "every_policy_fails"]}
    listed = client.get("/api/v1/tasks/quarantine").json()["results"]
    assert [q["task_id"] for q in listed] == ["broken"]
    # the same key again replaces the run: a fixed verifier lifts the quarantine
    client.post(
        "/api/v1/tasks/broken/reference-runs",
        {
            "task_version": "v1",
            "image_digest": "sha256:ab",
            "verifier_version": "3",
            "reference_outcome": "pass",
            "initial_outcome": "fail",
        },
        format="json",
    )
    body = client.get("/api/v1/tasks/broken/difficulty").json()
    assert body["quarantine"] is False and len(body["reference_runs"]) == 1
    assert TaskDifficulty.objects.get(task_id="broken", family="m-1").quarantine is False
    bulk = client.get("/api/v1/tasks/difficulty", {"ids": "broken"}).json()
    assert [r[6] for r in bulk["rows"]] == [False, False] and bulk["quarantine"] == {}


def test_it_takes_a_reference_run_from_an_episode_and_refuses_an_infra_one(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    ref = closed_episode(tenant, "ref-task", "verifier", verifier_outcome="error")
    lost = closed_episode(tenant, "ref-task", "environment")
    refused = client.post(
        "/api/v1/tasks/ref-task/reference-runs",
        {"reference_episode_id": lost.episode_id},
        format="json",
    )
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "reference_run_invalid"
    taken = client.post(
        "/api/v1/tasks/ref-task/reference-runs",
        {"reference_episode_id": ref.episode_id},
        format="json",
    )
    assert taken.status_code == 201
    assert (taken.json()["reference_outcome"], taken.json()["source"]) == ("error", "episode")
    missing = client.post("/api/v1/tasks/ref-task/reference-runs", {}, format="json")
    assert missing.status_code == 400 and missing.json()["error"]["field"] == "reference_outcome"


def test_it_quarantines_a_task_whose_failures_are_mostly_infra(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    for cls in ("environment", "environment", "startup", "task", "success"):
        closed_episode(tenant, "flaky", cls, model="m")
    body = client.get("/api/v1/tasks/flaky/difficulty").json()
    assert body["quarantine"] is True and body["verifier_suspect"] is False
    (fact,) = body["evidence"]
    assert (fact["rule"], fact["infra"], fact["failures"], fact["share"]) == (
        "mostly_infra_failures",
        3,
        1,
        0.75,
    )
    # 2 infra of 4 failures is not "mostly"
    for cls in ("environment", "environment"):
        closed_episode(tenant, "hard", cls, model="m")
    for cls in ("task", "task"):
        closed_episode(tenant, "hard", cls, model="m")
    assert client.get("/api/v1/tasks/hard/difficulty").json()["quarantine"] is False


def test_decay_weights_and_rebuild(make_tenant):
    assert decay_weights(3, 0.5) == [0.25, 0.5, 1.0]
    assert decay_weights(2, 1.0) == [1.0, 1.0]
    tenant, _ = make_tenant()
    closed_episode(
        tenant,
        "r",
        "success",
        model="m",
        policy_version="a",
        started_at=timezone.now() - timedelta(hours=1),
    )
    closed_episode(tenant, "r", "task", model="m", policy_version="b")
    assert TaskDifficulty.objects.get(task_id="r").s_eff == 0.5
    with override_settings(HEDGEROW_DIFFICULTY_DECAY=1.0):
        assert difficulty_rebuild(tenant=tenant) == 2
    row = TaskDifficulty.objects.get(task_id="r")
    assert (row.s_eff, row.f_eff) == (1.0, 1.0)
