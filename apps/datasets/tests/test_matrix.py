"""The harness × policy matrix on a small set checked by hand."""

from __future__ import annotations

import pytest

from apps.datasets.tests.factories import closed_episode

pytestmark = pytest.mark.django_db

# (policy, harness, task, class); t3 is only in one cell: not paired, left out.
ROWS = [
    ("p0", "A", "t1", "success"), ("p0", "A", "t1", "task"), ("p0", "A", "t2", "task"),
    ("p0", "A", "t3", "success"),
    ("p1", "A", "t1", "success"), ("p1", "A", "t2", "success"), ("p1", "A", "t2", "task"),
    ("p0", "B", "t1", "task"), ("p0", "B", "t2", "task"), ("p0", "B", "t2", "environment"),
    ("p1", "B", "t1", "success"), ("p1", "B", "t2", "success"),
]  # fmt: skip


def _seed(tenant):
    for policy, harness, task, cls in ROWS:
        tokens = 1000 if task == "t3" else 10
        closed_episode(
            tenant,
            task,
            cls,
            policy_version=policy,
            harness=harness,
            resources={"tokens_in": tokens, "tokens_out": 5, "steps": 2},
        )


def test_it_computes_cells_interaction_and_intervals_by_hand(make_tenant, api_client):
    tenant, secret = make_tenant()
    _seed(tenant)
    client = api_client(secret)
    response = client.get(
        "/api/v1/episodes/matrix", {"policies": "p0,p1", "harnesses": "A,B", "seed": "1"}
    )
    assert response.status_code == 200, response.content
    m = response.json()
    assert m["paired_tasks"] == ["t1", "t2"] and m["unpaired_tasks"] == ["t3"]
    cells = {(c["policy"], c["harness"]): c for c in m["cells"]}
    # S = mean over paired tasks of the task's success rate on valid episodes
    # p0·A: t1 1/2, t2 0/1 → 0.25; p1·A: t1 1, t2 1/2 → 0.75; p0·B: 0, 0 → 0; p1·B: 1, 1 → 1
    assert cells[("p0", "A")]["S"] == 0.25
    assert cells[("p1", "A")]["S"] == 0.75
    assert cells[("p0", "B")]["S"] == 0.0
    assert cells[("p1", "B")]["S"] == 1.0
    # p0·B: N 3 on paired tasks, the environment one invalid → η 2/3
    assert (cells[("p0", "B")]["n"], cells[("p0", "B")]["valid"]) == (3, 2)
    assert cells[("p0", "B")]["eta"] == pytest.approx(2 / 3)
    # pooled success on valid episodes: p0·A 1 of 3
    assert cells[("p0", "A")]["success_valid"] == pytest.approx(1 / 3)
    # Δ_int = (S_1B − S_0B) − (S_1A − S_0A) = (1 − 0) − (0.75 − 0.25) = 0.5
    assert m["interaction"]["delta_int"] == 0.5
    # every resample of {t1, t2} gives 0.5 (t1 alone: 1 − 0.5; t2 alone: 1 − 0.5)
    assert m["interaction"]["ci95"] == [0.5, 0.5]
    # S(p0, A) over resamples takes 0 (t2,t2), 0.25, 0.5 (t1,t1): the interval spans them
    assert cells[("p0", "A")]["ci95"] == [0.0, 0.5]
    # per task, p0 → p1 on A: t1 0.5 → 1, t2 0 → 0.5: both improved
    comps = {c["harness"]: c for c in m["comparisons"]}
    assert (comps["A"]["improved"], comps["A"]["regressed"], comps["A"]["unchanged"]) == (2, 0, 0)
    assert comps["A"]["delta"] == 0.5 and comps["B"]["delta"] == 1.0
    # budgets only over paired tasks (t3's 1000 tokens are not in p0·A's mean)
    assert cells[("p0", "A")]["tokens_per_episode"] == 15.0
    assert cells[("p0", "A")]["steps_per_episode"] == 2.0
    again = client.get(
        "/api/v1/episodes/matrix", {"policies": "p0,p1", "harnesses": "A,B", "seed": "1"}
    ).json()
    assert again == m


def test_it_refuses_a_bad_query_and_sees_only_its_team(make_tenant, api_client):
    tenant, secret = make_tenant()
    _seed(tenant)
    _, other_secret = make_tenant()
    client = api_client(secret)
    for params, field in (
        ({"harnesses": "A"}, "policies"),
        ({"policies": "p0", "harnesses": "A", "policy_field": "colour"}, "policy_field"),
        ({"policies": "p0,p0", "harnesses": "A"}, "policies"),
        ({"policies": "p0", "harnesses": "A", "bootstrap": "x"}, "bootstrap"),
    ):
        response = client.get("/api/v1/episodes/matrix", params)
        assert response.status_code == 400, params
        assert response.json()["error"]["field"] == field
    other = (
        api_client(other_secret)
        .get("/api/v1/episodes/matrix", {"policies": "p0,p1", "harnesses": "A,B"})
        .json()
    )
    assert other["paired_tasks"] == [] and all(c["n"] == 0 for c in other["cells"])
