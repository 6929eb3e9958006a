"""Issue 22, verifier health: an episode of a task whose verifier failed the task's
reference solution is class ``verifier`` (invalid), whatever its verifier said."""

from __future__ import annotations

import pytest

from apps.trajectories.models import Episode

pytestmark = pytest.mark.django_db

REF_KEY = {"task_version": "v1", "image_digest": "sha256:ab", "verifier_version": "3"}


def _episode(client, task_id):
    opened = client.post("/api/v1/episodes", {"task_id": task_id}, format="json")
    assert opened.status_code == 201, opened.content
    ep = opened.json()["id"]
    closed = client.post(
        f"/api/v1/episodes/{ep}/close",
        {"termination_reason": "submitted", "verifier_outcome": "pass", "reward": 1.0},
        format="json",
    )
    assert closed.status_code == 200, closed.content
    return closed.json()


def _reference(client, task_id, outcome):
    posted = client.post(
        f"/api/v1/tasks/{task_id}/reference-runs",
        {**REF_KEY, "reference_outcome": outcome},
        format="json",
    )
    assert posted.status_code == 201, posted.content


def test_a_suspect_tasks_episodes_are_verifier_until_the_verifier_is_fixed(make_tenant, api_client):
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    client, other = api_client(secret), api_client(other_secret)
    _reference(client, "broken", "fail")

    suspect = _episode(client, "broken")
    assert (suspect["failure_class"], suspect["auto_failure_class"]) == ("verifier", "verifier")
    row = Episode.objects.get(episode_id=suspect["id"])
    decisive, *facts = row.failure_evidence
    assert (decisive["class"], decisive["rule"], decisive["verdict_class"]) == (
        "verifier",
        "task_verifier_suspect",
        "success",
    )
    task_fact = facts[0]
    assert (task_fact["source"], task_fact["rule"], task_fact["verifier_version"]) == (
        "task",
        "verifier_fails_reference",
        "3",
    )
    # the client's pass is still in the evidence, as the verdict it reported
    assert any(f.get("source") == "client" and "pass" in f["detail"] for f in facts)
    stats = client.get("/api/v1/episodes/stats", {"task": "broken"}).json()
    assert (stats["episodes"], stats["valid"], stats["eta"]) == (1, 0, 0)

    # a healthy task, and another tenant's task of the same name, are untouched
    assert _episode(client, "fine")["failure_class"] == "success"
    assert _episode(other, "broken")["failure_class"] == "success"

    # a fixed verifier, run on the reference as an ordinary episode: that episode is
    # verifier too (the task is still suspect), but the run records what the verifier
    # said (pass), so the same key lifts the quarantine
    reference = _episode(client, "broken")
    assert reference["failure_class"] == "verifier"
    taken = client.post(
        "/api/v1/tasks/broken/reference-runs",
        {**REF_KEY, "reference_episode_id": reference["id"]},
        format="json",
    )
    assert taken.status_code == 201, taken.content
    assert (taken.json()["reference_outcome"], taken.json()["source"]) == ("pass", "episode")
    assert taken.json()["status"] == "done"  # a reported run is evidence as recorded
    health = client.get("/api/v1/tasks/broken/difficulty").json()
    assert (health["verifier_suspect"], health["quarantine"]) == (False, False)
    # re-attribution reads the lifted flag: the verdict counts again
    again = client.post(f"/api/v1/episodes/{suspect['id']}/attribute", format="json")
    assert again.status_code == 200, again.content
    assert again.json()["failure_class"] == "success"
