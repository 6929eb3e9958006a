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


def _closed(client, task_id, task_version="", **result):
    opened = client.post(
        "/api/v1/episodes", {"task_id": task_id, "task_version": task_version}, format="json"
    )
    assert opened.status_code == 201, opened.content
    ep = opened.json()["id"]
    closed = client.post(f"/api/v1/episodes/{ep}/close", result, format="json")
    assert closed.status_code == 200, closed.content
    return ep


def _classes(*ids):
    rows = Episode.objects.filter(episode_id__in=ids)
    return {e.episode_id: (e.auto_failure_class, e.failure_class) for e in rows}


def test_closed_episodes_move_to_verifier_when_the_task_becomes_suspect_and_back_when_cleared(
    make_tenant, api_client
):
    from apps.datasets.services.verifier_health import task_episodes_reattribute
    from apps.datasets.tasks import reattribute_task_episodes
    from apps.trajectories.models import EpisodeReattribution

    tenant, secret = make_tenant()
    other_tenant, other_secret = make_tenant()
    client, other = api_client(secret), api_client(other_secret)
    PASS = {"termination_reason": "submitted", "verifier_outcome": "pass", "reward": 1.0}
    FAIL = {"termination_reason": "submitted", "verifier_outcome": "fail", "reward": 0.0}
    passed = _closed(client, "t", "v1", **PASS)
    failed = _closed(client, "t", "", **FAIL)
    no_verdict = _closed(client, "t", "v1", termination_reason="harness_crash")
    other_version = _closed(client, "t", "v2", **PASS)
    labelled = _closed(client, "t", "v1", **FAIL)
    relabel = client.post(
        f"/api/v1/episodes/{labelled}/relabel",
        {"failure_class": "environment", "reason": "a person looked"},
        format="json",
    )
    assert relabel.status_code == 200, relabel.content
    theirs = _closed(other, "t", "v1", **PASS)
    before = _classes(passed, failed, no_verdict, other_version, labelled, theirs)
    assert before[passed] == ("success", "success") and before[failed] == ("task", "task")
    assert client.get("/api/v1/episodes/stats", {"task": "t"}).json()["valid"] == 3

    _reference(client, "t", "fail")  # REF_KEY's task_version is v1
    # the flag alone does not rewrite closed episodes: the bulk job does
    assert _classes(passed, failed)[passed] == ("success", "success")
    assert reattribute_task_episodes(str(tenant.pk), "t") == 3

    after = _classes(passed, failed, no_verdict, other_version, labelled, theirs)
    assert after[passed] == ("verifier", "verifier")
    assert after[failed] == ("verifier", "verifier")  # no version named: the task's
    assert after[no_verdict] == before[no_verdict] == ("undetermined", "undetermined")
    assert after[other_version] == ("success", "success")  # v2: no run judged its verifier
    assert after[labelled] == ("verifier", "environment")  # a person's label stands
    assert after[theirs] == ("success", "success")  # another tenant's task of that name
    stats = client.get("/api/v1/episodes/stats", {"task": "t"}).json()
    assert (stats["episodes"], stats["valid"]) == (5, 1)

    moved = EpisodeReattribution.objects.get(episode__episode_id=passed)
    assert (moved.tenant_id, moved.from_class, moved.to_class, moved.verdict_class) == (
        tenant.pk,
        "success",
        "verifier",
        "success",
    )
    assert moved.cause == "task_verifier_suspect" and "verifier_suspect" in moved.reason
    assert moved.evidence[0]["rule"] == "verifier_fails_reference"
    assert moved.evidence[0]["task_version"] == "v1"
    assert EpisodeReattribution.objects.get(episode__episode_id=failed).verdict_class == "task"
    decisive = Episode.objects.get(episode_id=passed).failure_evidence[0]
    assert decisive["rule"] == "task_verifier_suspect"

    # idempotent: a second run (a retried or duplicated job) changes and records nothing
    assert reattribute_task_episodes(str(tenant.pk), "t") == 0
    assert EpisodeReattribution.objects.filter(tenant=tenant).count() == 3
    assert not EpisodeReattribution.objects.filter(tenant=other_tenant).exists()

    # a later passing reference run clears the flag: they move back, recorded
    _reference(client, "t", "pass")
    # bounded: batches of 2 follow the cursor until it is exhausted
    changed, cursor, batches = 0, None, 0
    while True:
        n, cursor = task_episodes_reattribute(
            tenant_id=tenant.pk, task_id="t", after=cursor, limit=2
        )
        changed, batches = changed + n, batches + 1
        if cursor is None:
            break
    assert (changed, batches) == (3, 3)  # 5 episodes: 2 + 2 + 1
    assert _classes(passed, failed, labelled) == {
        passed: ("success", "success"),
        failed: ("task", "task"),
        labelled: ("task", "environment"),
    }
    back = EpisodeReattribution.objects.filter(episode__episode_id=passed).order_by("id")
    assert [(r.from_class, r.to_class, r.cause) for r in back] == [
        ("success", "verifier", "task_verifier_suspect"),
        ("verifier", "success", "task_verifier_cleared"),
    ]
    assert client.get("/api/v1/episodes/stats", {"task": "t"}).json()["valid"] == 3
    # the API answers the same history (the list and one episode), another tenant nothing
    shown = client.get(f"/api/v1/episodes/{passed}").json()["reattributions"]
    assert [(r["from_class"], r["to_class"], r["verdict_class"], r["cause"]) for r in shown] == [
        ("success", "verifier", "success", "task_verifier_suspect"),
        ("verifier", "success", "success", "task_verifier_cleared"),
    ]
    assert shown[0]["evidence"][0]["rule"] == "verifier_fails_reference"
    listed = {
        e["id"]: e["reattributions"] for e in client.get("/api/v1/episodes").json()["results"]
    }
    assert len(listed[passed]) == 2 and listed[other_version] == []
    assert other.get(f"/api/v1/episodes/{passed}").status_code == 404
    assert other.get(f"/api/v1/episodes/{theirs}").json()["reattributions"] == []


def test_the_episode_page_shows_the_move(make_tenant, api_client, make_user, client):
    from apps.datasets.tasks import reattribute_task_episodes

    tenant, secret = make_tenant()
    other_tenant, _ = make_tenant()
    api = api_client(secret)
    ep = _closed(api, "paged", termination_reason="submitted", verifier_outcome="pass")
    client.force_login(make_user("vera", (tenant, "owner")))
    assert 'id="reattributions"' not in client.get(f"/trajectories/{ep}/").content.decode()
    _reference(api, "paged", "fail")
    assert reattribute_task_episodes(str(tenant.pk), "paged") == 1
    page = client.get(f"/trajectories/{ep}/").content.decode()
    assert '<ol id="reattributions">' in page
    assert "success → <strong>verifier</strong> (the verdict said success;" in page
    assert "<code>task_verifier_suspect</code>" in page
    assert "became verifier_suspect: the verifier gave fail on the reference solution" in page
    client.force_login(make_user("otto", (other_tenant, "owner")))
    assert client.get(f"/trajectories/{ep}/").status_code == 404
