"""The counterfactual estimate on a hand-checked set (issue 16): branches of one
episode at step t in two arms, infrastructure failures left out by class."""

from __future__ import annotations

from typing import Any

import pytest

from apps.trajectories.models import Episode, EpisodeStatus, FailureClass, Step

pytestmark = pytest.mark.django_db


def _branch(parent: Episode, arm: str, reward: float | None, failure: str = "") -> Episode:
    return Episode.objects.create(
        tenant=parent.tenant,
        task_id=parent.task_id,
        parent=parent,
        branch_step=2,
        labels={"arm": arm},
        status=EpisodeStatus.CLOSED,
        reward=reward,
        failure_class=failure,
    )


def test_it_computes_delta_and_welchs_interval_leaving_infra_failures_out(
    make_tenant: Any, api_client: Any
) -> None:
    tenant, secret = make_tenant()
    root = Episode.objects.create(tenant=tenant, task_id="t")
    for index in range(3):
        Step.objects.create(episode=root, index=index)
    for reward in (1.0, 1.0, 0.0, 1.0):
        _branch(root, "with", reward)
    for reward in (0.0, 1.0, 0.0, 0.0):
        _branch(root, "without", reward)
    # never scored as reward 0: an environment failure, a startup failure, no reward
    _branch(root, "with", 0.0, FailureClass.ENVIRONMENT)
    _branch(root, "without", None, FailureClass.STARTUP)
    _branch(root, "without", None)
    _branch(root, "other", 1.0)  # neither arm
    Episode.objects.create(  # another step's branch
        tenant=tenant, task_id="t", parent=root, branch_step=1, labels={"arm": "with"},
        status=EpisodeStatus.CLOSED, reward=0.0,
    )  # fmt: skip
    client = api_client(secret)

    body = client.get(f"/api/v1/episodes/{root.episode_id}/counterfactual", {"step": 2}).json()

    # by hand: means 0.75 and 0.25; both sample variances 0.25, so v = 0.25/4 = 0.0625
    # per arm, se = √0.125 = 0.353553; Welch's df = 0.125² / (2·0.0625²/3) = 6;
    # t(6, 0.975) = 2.447 → ±0.865145
    assert (body["n_plus"], body["n_minus"]) == (4, 4)
    assert (body["mean_plus"], body["mean_minus"]) == (0.75, 0.25)
    assert body["delta"] == pytest.approx(0.5)
    assert body["df"] == pytest.approx(6.0)
    assert body["ci95"] == pytest.approx([0.5 - 0.865145, 0.5 + 0.865145], abs=1e-6)
    assert body["excluded"] == {"environment": 1, "startup": 1, "no_reward": 1}

    renamed = client.get(
        f"/api/v1/episodes/{root.episode_id}/counterfactual",
        {"step": 2, "label": "arm", "plus": "without", "minus": "with"},
    ).json()
    assert renamed["delta"] == pytest.approx(-0.5)
    empty = client.get(f"/api/v1/episodes/{root.episode_id}/counterfactual", {"step": 0}).json()
    assert (empty["delta"], empty["ci95"]) == (None, None)
    assert client.get(f"/api/v1/episodes/{root.episode_id}/counterfactual").status_code == 400
    _, other = make_tenant()
    foreign = api_client(other).get(
        f"/api/v1/episodes/{root.episode_id}/counterfactual", {"step": 2}
    )
    assert foreign.status_code == 404
