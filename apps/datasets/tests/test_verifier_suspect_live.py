"""Issue 22, verifier health: a reference run that makes a task verifier_suspect (or
clears it) queues the bulk re-attribution of its closed episodes; the real Celery worker
runs it. The job itself (idempotence, batches, versions, records) is tested in
test_verifier_suspect.py."""

from __future__ import annotations

import time

import pytest

from apps.trajectories.models import Episode, EpisodeReattribution

pytestmark = pytest.mark.timeout(180)

REF_KEY = {"task_version": "v1", "image_digest": "sha256:ab", "verifier_version": "3"}


def _class_becomes(episode_id: str, wanted: str, timeout: float = 60) -> Episode:
    """The episode once the worker's job gave it class ``wanted``."""
    deadline = time.monotonic() + timeout
    while True:
        episode = Episode.objects.get(episode_id=episode_id)
        if episode.failure_class == wanted:
            return episode
        assert time.monotonic() < deadline, f"{episode_id} still {episode.failure_class}"
        time.sleep(0.2)


def test_a_flag_flip_queues_the_reattribution_the_worker_runs(live, make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    opened = client.post("/api/v1/episodes", {"task_id": "flips"}, format="json")
    assert opened.status_code == 201, opened.content
    ep = opened.json()["id"]
    closed = client.post(
        f"/api/v1/episodes/{ep}/close",
        {"termination_reason": "submitted", "verifier_outcome": "pass", "reward": 1.0},
        format="json",
    )
    assert closed.json()["failure_class"] == "success"

    posted = client.post(
        "/api/v1/tasks/flips/reference-runs",
        {**REF_KEY, "reference_outcome": "fail"},
        format="json",
    )
    assert posted.status_code == 201, posted.content
    moved = _class_becomes(ep, "verifier")
    assert moved.failure_evidence[0]["rule"] == "task_verifier_suspect"
    assert client.get("/api/v1/episodes/stats", {"task": "flips"}).json()["valid"] == 0

    cleared = client.post(
        "/api/v1/tasks/flips/reference-runs",
        {**REF_KEY, "reference_outcome": "pass"},
        format="json",
    )
    assert cleared.status_code == 201, cleared.content
    _class_becomes(ep, "success")
    causes = list(
        EpisodeReattribution.objects.filter(episode=moved).order_by("id").values_list("cause")
    )
    assert causes == [("task_verifier_suspect",), ("task_verifier_cleared",)]
