"""Leakage-aware splits: grouping, determinism, temporal cut-offs, export, card, tenancy."""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.datasets.models import DatasetEpisode
from apps.datasets.tests.factories import closed_episode

pytestmark = pytest.mark.django_db

# Tasks sharing a file or a failing test must land together; each has several rollouts.
TASKS = {
    "t1": {"affected_files": ["src/a.py"], "failing_tests": ["test_a"]},
    "t2": {"affected_files": ["src/a.py", "src/b.py"], "failing_tests": ["test_b"]},
    "t3": {"affected_files": ["src/b.py"], "failing_tests": ["test_c"]},  # joins t1, t2 via b.py
    "t4": {"affected_files": ["src/d.py"], "failing_tests": ["test_c"]},
    "t5": {"affected_files": ["src/e.py"], "failing_tests": ["test_e"]},
    "t6": {"affected_files": ["src/f.py"], "failing_tests": ["test_f"]},
    "t7": {"affected_files": ["src/g.py"], "failing_tests": ["test_g"]},
    "t8": {},  # no metadata: a group of its own
}


def _seed(tenant, client, rollouts=3):
    for task_id, meta in TASKS.items():
        put = client.put(
            f"/api/v1/tasks/{task_id}", {"metadata": meta, "licence": "MIT"}, format="json"
        )
        assert put.status_code == 201, put.content
        for i in range(rollouts):
            closed_episode(tenant, task_id, "success" if i == 0 else "task", model="m")


def _membership(dataset_id):
    return {
        (m.episode.task_id, m.episode.episode_id): m.split
        for m in DatasetEpisode.objects.filter(dataset__dataset_id=dataset_id).select_related(
            "episode"
        )
    }


def _independent_leak_check(membership, key):
    """No task, and no value of ``key`` (from TASKS), in two splits: checked here from
    scratch, not from what the service says about itself."""
    splits_of = defaultdict(set)
    for (task_id, _), split in membership.items():
        splits_of[("task", task_id)].add(split)
        for value in TASKS[task_id].get(key, []):
            splits_of[(key, value)].add(split)
    return {k: v for k, v in splits_of.items() if len(v) > 1}


def test_it_never_lets_related_tasks_straddle_splits(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    _seed(tenant, client)
    for key in ("affected_files", "failing_tests", "task"):
        body = {
            "name": key,
            "group_by": key,
            "fractions": {"train": 0.5, "validation": 0.25, "test": 0.25},
            "seed": 7,
        }
        created = client.post("/api/v1/datasets", body, format="json")
        assert created.status_code == 201, created.content
        data = created.json()
        membership = _membership(data["id"])
        assert len(membership) == 24  # every closed episode, once
        assert _independent_leak_check(membership, key) == {}
        assert data["leak_check"]["ok"] is True
        assert data["leak_check"]["tasks_in_two_splits"] == 0
        counted = sum(data["splits"][s]["episodes"] for s in ("train", "validation", "test"))
        assert counted == 24
        assert sum(data["splits"][s]["by_class"]["success"] for s in data["splits"]) == 8
    # affected_files: t1, t2, t3 are one group (a.py joins t1–t2, b.py joins t2–t3)
    files = client.post("/api/v1/datasets", {"group_by": "affected_files"}, format="json").json()
    groups = {
        m.episode.task_id: m.group
        for m in DatasetEpisode.objects.filter(dataset__dataset_id=files["id"]).select_related(
            "episode"
        )
    }
    assert groups["t1"] == groups["t2"] == groups["t3"] == "t1"
    assert len(set(groups.values())) == 6
    assert files["excluded"] == {"tasks_without_key": 1}


def test_it_is_deterministic_for_a_seed(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    _seed(tenant, client)
    body = {"group_by": "task", "seed": 3}
    a = client.post("/api/v1/datasets", body, format="json").json()
    b = client.post("/api/v1/datasets", body, format="json").json()
    assert a["id"] != b["id"]
    assert _membership(a["id"]) == _membership(b["id"])
    seeds = [
        _membership(client.post("/api/v1/datasets", {"seed": s}, format="json").json()["id"])
        for s in range(4)
    ]
    assert len({tuple(sorted(m.items())) for m in seeds}) > 1  # the seed matters


def test_it_cuts_by_time_and_keeps_a_late_group_out_of_train(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    now = timezone.now()
    old, mid, new = now - timedelta(days=30), now - timedelta(days=10), now - timedelta(days=1)
    closed_episode(tenant, "early", "success", started_at=old)
    closed_episode(tenant, "middle", "task", started_at=mid)
    closed_episode(tenant, "straddles", "task", started_at=old)
    closed_episode(tenant, "straddles", "success", started_at=new)  # a rollout after the cut
    closed_episode(tenant, "late", "success", started_at=new)
    body = {
        "temporal": {
            "field": "episode_started_at",
            "validation_from": (now - timedelta(days=15)).isoformat(),
            "test_from": (now - timedelta(days=5)).isoformat(),
        }
    }
    created = client.post("/api/v1/datasets", body, format="json")
    assert created.status_code == 201, created.content
    by_task = {task: split for (task, _), split in _membership(created.json()["id"]).items()}
    assert by_task == {
        "early": "train",
        "middle": "validation",
        "straddles": "test",
        "late": "test",
    }


def test_it_cuts_by_task_metadata_time_and_leaves_out_tasks_without_one(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    client.put(
        "/api/v1/tasks/a", {"metadata": {"fix_merged_at": "2025-01-01T00:00:00Z"}}, format="json"
    )
    client.put(
        "/api/v1/tasks/b", {"metadata": {"fix_merged_at": "2026-06-01T00:00:00Z"}}, format="json"
    )
    for task in ("a", "b", "c"):
        closed_episode(tenant, task, "success")
    created = client.post(
        "/api/v1/datasets",
        {
            "fractions": {"train": 1.0},
            "temporal": {"field": "fix_merged_at", "test_from": "2026-01-01T00:00:00Z"},
        },
        format="json",
    ).json()
    by_task = {task: split for (task, _), split in _membership(created["id"]).items()}
    assert by_task == {"a": "train", "b": "test"}
    assert created["excluded"] == {"missing_time": 1}


def test_it_refuses_bad_definitions_with_typed_errors(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    closed_episode(tenant, "x", "success")
    cases = [
        ({"fractions": {"train": 0.5, "test": 0.1}}, "fractions"),
        ({"fractions": {"holdout": 1.0}}, "fractions.holdout"),
        ({"group_by": "colour"}, "group_by"),
        ({"filters": {"colour": "red"}}, "filters.colour"),
        ({"temporal": {"validation_from": "2026-01-01T00:00:00Z"}}, "temporal.test_from"),
        ({"temporal": {"test_from": "yesterday"}}, "temporal.test_from"),
        ({"seed": "x"}, "seed"),
        ({"filters": {"task": "nothing-like-this"}}, "filters"),
    ]
    for body, field in cases:
        response = client.post("/api/v1/datasets", body, format="json")
        assert response.status_code == 400, (body, response.content)
        assert response.json()["error"]["field"] == field, body
    empty = client.post("/api/v1/datasets", {"filters": {"task": "none"}}, format="json")
    assert empty.json()["error"]["code"] == "empty_dataset"
    bad_meta = client.put(
        "/api/v1/tasks/x", {"metadata": {"affected_files": "a.py"}}, format="json"
    )
    assert bad_meta.status_code == 400
    assert bad_meta.json()["error"]["field"] == "metadata.affected_files"
    assert not DatasetEpisode.objects.exists()


def test_it_exports_each_split_as_jsonl_and_hides_other_teams(make_tenant, api_client):
    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    client = api_client(secret)
    _seed(tenant, client, rollouts=2)
    data = client.post("/api/v1/datasets", {"seed": 1}, format="json").json()
    membership = _membership(data["id"])
    for split in ("train", "validation", "test"):
        response = client.get(f"/api/v1/datasets/{data['id']}/export", {"split": split})
        assert response.status_code == 200
        assert response.streaming
        lines = b"".join(response.streaming_content).decode().splitlines()
        ids = {json.loads(line)["episode_id"] for line in lines}
        assert ids == {ep for (_, ep), s in membership.items() if s == split}
        assert all(json.loads(line)["schema"] == "hedgerow.episode/v1" for line in lines)
    bad = client.get(f"/api/v1/datasets/{data['id']}/export", {"split": "holdout"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "split"
    other = api_client(other_secret)
    for path in ("", "/card", "/export?split=train"):
        response = other.get(f"/api/v1/datasets/{data['id']}{path}")
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "dataset_not_found"
    assert other.get("/api/v1/datasets").json()["results"] == []


def test_the_card_counts_classes_reasons_sources_and_licences(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    client.put("/api/v1/tasks/lic", {"licence": "Apache-2.0"}, format="json")
    closed_episode(
        tenant,
        "lic",
        "success",
        termination_reason="submitted",
        verifier_outcome="pass",
        reward=1.0,
        failure_evidence=[{"class": "success", "source": "operation"}],
    )
    closed_episode(
        tenant,
        "nolic",
        "environment",
        termination_reason="sandbox_lost",
        failure_evidence=[
            {"class": "environment", "source": "ledger"},
            {"class": "note", "source": "client"},
        ],
    )
    ds = client.post("/api/v1/datasets", {"fractions": {"train": 1.0}}, format="json").json()
    card = client.get(f"/api/v1/datasets/{ds['id']}/card").json()
    assert card["episodes"] == 2 and card["valid"] == 1 and card["eta"] == 0.5
    assert card["by_class"]["success"] == 1 and card["by_class"]["environment"] == 1
    assert card["by_termination_reason"] == {"sandbox_lost": 1, "submitted": 1}
    assert card["evidence_sources"] == {"client": 1, "ledger": 1, "operation": 1}
    assert card["licences"] == {"Apache-2.0": 1, "unrecorded": 1}
    assert card["outcomes"]["verifier"] == {"none": 1, "pass": 1}
    assert card["outcomes"]["reward"]["mean"] == 1.0
    assert card["secret_scan"]["available"] is True
    assert card["secret_scan"]["episodes_with_secrets"] == 0
    assert card["segment_lengths"] == {
        "available": True,
        "layer": "newest segments layer per episode",
        "summary": None,
    }
    assert card["source"]["group_by"] == "task"


def test_the_card_summarises_segments_retention_and_the_secret_scan(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    token = "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"
    ep = client.post("/api/v1/episodes", {"task_id": "seg"}, format="json").json()
    path = f"/api/v1/episodes/{ep['id']}"
    steps = [{"kind": "model", "action": "think"}, {"kind": "tool", "action": f"use {token}"}]
    steps.append({"kind": "model", "action": "done"})
    assert client.post(f"{path}/steps", {"steps": steps}, format="json").status_code == 201
    assert client.post(f"{path}/close", {"reward": 1.0}, format="json").status_code == 200
    (normalized,) = client.get(f"{path}/lineage").json()["layers"]
    segments = {
        "kind": "segments",
        "source_layer": normalized["id"],
        "producer": "s",
        "producer_version": "1",
        "items": [{"steps": [0, 2], "reason": "all"}, {"steps": [1, 1], "reason": "tool"}],
    }
    assert client.post(f"{path}/layers", segments, format="json").status_code == 201
    ds = client.post("/api/v1/datasets", {"fractions": {"train": 1.0}}, format="json").json()
    card = client.get(f"/api/v1/datasets/{ds['id']}/card").json()
    lengths = card["segment_lengths"]["summary"]
    assert (lengths["n"], lengths["min"], lengths["max"]) == (2, 1.0, 3.0)
    layers = card["lineage_retention"]["layers"]
    assert layers["normalized"] == {"episodes": 1, "rate": 1.0}
    assert layers["segments"] == {"episodes": 1, "rate": 1.0}
    assert layers["packed"] == {"episodes": 0, "rate": 0.0}
    scan = card["secret_scan"]
    assert scan["episodes_with_secrets"] == 1 and "github_token" in json.dumps(scan)
    assert token not in json.dumps(card)


def test_a_withdrawal_names_the_datasets_it_shrinks_and_they_record_it(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    _seed(tenant, client)
    body = {"name": "all", "group_by": "task", "seed": 1}
    created = client.post("/api/v1/datasets", body, format="json")
    assert created.status_code == 201, created.content
    dataset_id = created.json()["id"]
    assert len(_membership(dataset_id)) == 24

    withdrawn = client.post(
        "/api/v1/lineage/withdrawals",
        {"task_id": "t5", "reason": "licence withdrawn"},
        format="json",
    )
    assert withdrawn.status_code == 201, withdrawn.content
    entry = {
        "dependent": "datasets",
        "kind": "dataset",
        "id": dataset_id,
        "name": "all",
        "action": "members_removed",
        "episodes": 3,
    }
    assert entry in withdrawn.json()["affects"]
    left = _membership(dataset_id)
    assert len(left) == 21 and all(task != "t5" for task, _ in left)
    detail = client.get(f"/api/v1/datasets/{dataset_id}").json()
    (record,) = detail["excluded"]["withdrawn"]
    assert record["episodes"] == 3 and record["reason"] == "licence withdrawn"
