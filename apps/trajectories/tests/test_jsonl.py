"""JSONL export/import: lossless round trip, line-numbered errors that do not stop
at the first bad line."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode

pytestmark = pytest.mark.django_db


def _export(client) -> bytes:
    response = client.get("/api/v1/episodes/export")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    return b"".join(response.streaming_content)


def _import(client, body: bytes, **params):
    path = "/api/v1/episodes/import"
    if params:
        path += "?" + "&".join(f"{k}={v}" for k, v in params.items())
    return client.generic("POST", path, body, content_type="application/x-ndjson")


def _rich_episode(client, sandbox_id: str) -> str:
    ep = client.post(
        "/api/v1/episodes",
        {
            "task_id": "swe-1",
            "task_version": "v3",
            "model": "m",
            "model_version": "2026-01",
            "harness": "h",
            "harness_version": "0.4",
            "policy_version": "step-1200",
            "sampling": {"temperature": 0.2, "top_p": 0.95},
            "labels": {"run": "nightly"},
            "initial_state": "sha256:abc",
            "image": "host",
            "sandbox_ids": [sandbox_id],
        },
        format="json",
    ).json()
    client.post(
        f"/api/v1/episodes/{ep['id']}/steps",
        {
            "steps": [
                {
                    "kind": "model",
                    "action": "I will run ls ✓",
                    "shown": {"text": "prompt…"},
                    "model_call": {"tokens_in": 100, "tokens_out": 7, "latency_s": 0.5},
                },
                {
                    "kind": "tool",
                    "action": {"name": "edit", "args": {"path": "a.py"}},
                    "observation": {"ok": True},
                    "diff": "--- a.py\n+++ a.py\n@@\n-x\n+y\n",
                    "duration_s": 0.25,
                },
            ]
        },
        format="json",
    )
    client.post(
        f"/api/v1/episodes/{ep['id']}/close",
        {"verifier_outcome": "fail", "reward": 0.0, "reward_components": {"tests": 0.0}},
        format="json",
    )
    client.post(
        f"/api/v1/episodes/{ep['id']}/relabel",
        {"failure_class": "verifier", "reason": "flaky test"},
        format="json",
    )
    return str(ep["id"])


def test_it_round_trips_episodes_through_jsonl_losslessly(make_tenant, api_client):
    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    source, target = api_client(secret), api_client(other_secret)
    sandbox = make_sandbox(tenant, ready_at=timezone.now())
    episode_id = _rich_episode(source, sandbox.external_id)
    first = _export(source)
    record = json.loads(first)
    assert record["schema"] == "hedgerow.episode/v1"
    assert record["failure"]["auto_class"] == "task" and record["failure"]["class"] == "verifier"
    assert record["steps"][1]["diff"].startswith("--- a.py")

    imported = _import(target, first)
    assert imported.status_code == 200, imported.content
    assert imported.json()["imported"] == 1
    second = _export(target)
    assert second == first  # byte for byte: nothing lost, nothing added
    row = Episode.objects.get(episode_id=episode_id, imported=True)
    assert row.relabels.get().reason == "flaky test"
    assert row.sandbox_links.get().sandbox is None  # a reference only: another tenant's


def test_it_reports_every_bad_line_with_its_number_and_imports_the_good_ones(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    good = {
        "schema": "hedgerow.episode/v1",
        "episode_id": "ep-good",
        "task_id": "t",
        "started_at": "2026-01-01T00:00:00+00:00",
    }
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "episode_id": "ep-2", "schema": "hedgerow.episode/v0"}),
        "",
        json.dumps({**good, "episode_id": "ep-3", "task_id": ""}),
        json.dumps({**good, "episode_id": "ep-4", "steps": [{"index": 0, "kind": "dance"}]}),
        json.dumps({**good, "episode_id": "ep-5", "started_at": "yesterday"}),
        json.dumps(good),  # a duplicate of line 1
        json.dumps({**good, "episode_id": "ep-ok-2", "failure": {"class": "task"}}),
    ]
    body = "\n".join(lines).encode()
    dry = _import(client, body, dry_run="true")
    assert dry.status_code == 207 and dry.json()["imported"] == 2
    assert not Episode.objects.filter(tenant=tenant).exists()

    response = _import(client, body)
    assert response.status_code == 207
    report = response.json()
    errors = {(e["line"], e["field"]) for e in report["errors"]}
    assert errors == {
        (2, None),
        (3, "schema"),
        (5, "task_id"),
        (6, "steps[0].kind"),
        (7, "started_at"),
        (8, "episode_id"),
    }
    assert report["imported"] == 2 and report["failed"] == 6
    assert set(Episode.objects.filter(tenant=tenant).values_list("episode_id", flat=True)) == {
        "ep-good",
        "ep-ok-2",
    }


def test_a_branch_keeps_its_parent_and_step_through_jsonl(make_tenant, api_client):
    from apps.trajectories.models import Step

    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    root = Episode.objects.create(tenant=tenant, task_id="t", episode_id="root-1")
    Step.objects.create(episode=root, index=0)
    Episode.objects.create(
        tenant=tenant, task_id="t", episode_id="branch-1", parent=root, branch_step=0
    )
    exported = _export(api_client(secret))
    records = {r["episode_id"]: r for r in map(json.loads, exported.splitlines())}
    assert "branch" not in records["root-1"]  # unchanged for episodes that are no branch
    assert records["branch-1"]["branch"] == {
        "parent_episode_id": "root-1",
        "step": 0,
        "snapshot_id": None,
    }
    # parents first, as the export orders them oldest first: the branch links to it
    lines = b"\n".join(json.dumps(records[i]).encode() for i in ("root-1", "branch-1"))
    imported = _import(api_client(other_secret), lines)
    assert imported.status_code == 200, imported.content
    branch = Episode.objects.get(episode_id="branch-1", imported=True)
    assert branch.parent is not None and branch.parent.episode_id == "root-1"
    assert branch.parent.imported and branch.branch_step == 0
