"""Provenance keys: content-derived, explicit `unknown`s, filter and group by any
component, recomputed when a component becomes known, backfilled for old rows."""

from __future__ import annotations

import hashlib
import importlib
import json
from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps as django_apps
from django.utils import timezone

from apps.sandboxes.models import Snapshot
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode

pytestmark = pytest.mark.django_db

FULL = {
    "task_hash": "sha256:task-aaaa",
    "policy_checkpoint": "ckpt-a",
    "harness_commit": "h-1111",
    "verifier_commit": "v-2222",
    "sampling": {"temperature": 0.7, "top_p": 0.9},
    "attempt_id": "att-1",
}


def _open(client: Any, **body: Any) -> dict[str, Any]:
    response = client.post("/api/v1/episodes", {"task_id": "t-1", **body}, format="json")
    assert response.status_code == 201, response.content
    result: dict[str, Any] = response.json()
    return result


def _snapshot(tenant: Any, sandbox: Any) -> Snapshot:
    return Snapshot.objects.create(
        tenant=tenant,
        sandbox=sandbox,
        backend="local",
        image="host",
        ttl_seconds=3600,
        expires_at=timezone.now() + timedelta(hours=1),
    )


def _hand_key(parts: list[tuple[str, str]]) -> str:
    body = json.dumps([list(p) for p in parts], separators=(",", ":"))
    return "hp1:" + hashlib.sha256(body.encode()).hexdigest()


def test_the_key_is_derived_from_every_component_by_hand(make_tenant, api_client):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, image_digest="sha256:img-1")
    ep = _open(api_client(secret), sandbox_ids=[sandbox.external_id], **FULL)
    sampling = hashlib.sha256(b'{"temperature":0.7,"top_p":0.9}').hexdigest()[:16]
    parts = [
        ("task", "sha256:task-aaaa"),
        ("image", "sha256:img-1"),
        ("snapshot", "none"),
        ("policy", "ckpt-a"),
        ("harness", "h-1111"),
        ("verifier", "v-2222"),
        ("sampling", f"sha256:{sampling}"),
        ("attempt", "att-1"),
    ]
    assert ep["provenance"]["components"] == dict(parts)
    assert ep["provenance"]["key"] == _hand_key(parts)
    assert ep["provenance"]["origin"] == _hand_key(parts[:-1])
    row = Episode.objects.get(episode_id=ep["id"])
    assert row.provenance_key == _hand_key(parts)


def test_missing_components_are_explicitly_unknown(make_tenant, api_client):
    _, secret = make_tenant()
    ep = _open(api_client(secret), attempt_id="att-x")
    components = ep["provenance"]["components"]
    assert components == {
        "task": "unknown",
        "image": "unknown",
        "snapshot": "none",
        "policy": "unknown",
        "harness": "unknown",
        "verifier": "unknown",
        "sampling": "unknown",
        "attempt": "att-x",
    }
    assert ep["provenance"]["key"].startswith("hp1:") and len(ep["provenance"]["key"]) == 68


def test_attempts_share_an_origin_and_sampling_changes_it(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    a = _open(client, **{**FULL, "attempt_id": "att-1"})
    b = _open(client, **{**FULL, "attempt_id": "att-2"})
    c = _open(client, **{**FULL, "attempt_id": "att-1", "sampling": {"temperature": 0.0}})
    assert a["provenance"]["origin"] == b["provenance"]["origin"]
    assert a["provenance"]["key"] != b["provenance"]["key"]
    assert c["provenance"]["origin"] != a["provenance"]["origin"]
    # same inputs, same key: content-derived, not an id
    d = _open(client, **{**FULL, "attempt_id": "att-1"})
    assert d["provenance"]["key"] == a["provenance"]["key"] and d["id"] != a["id"]


def test_the_verifier_version_given_at_close_enters_the_key(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    ep = _open(client, policy_version="step-1200")
    assert ep["provenance"]["components"]["policy"] == "step-1200"  # the documented fallback
    closed = client.post(
        f"/api/v1/episodes/{ep['id']}/close",
        {"verifier_outcome": "pass", "verifier_version": "3"},
        format="json",
    ).json()
    assert closed["provenance"]["components"]["verifier"] == "3"
    assert closed["provenance"]["key"] != ep["provenance"]["key"]


def test_a_forked_sandbox_puts_its_snapshot_into_the_initial_state(make_tenant, api_client):
    tenant, secret = make_tenant()
    parent = make_sandbox(tenant)
    snap = _snapshot(tenant, parent)
    child = make_sandbox(tenant, snapshot=snap, image_digest="sha256:img-2")
    ep = _open(api_client(secret), sandbox_ids=[child.external_id])
    assert ep["provenance"]["components"]["snapshot"] == str(snap.pk)
    assert ep["provenance"]["components"]["image"] == "sha256:img-2"


def test_it_filters_and_groups_by_any_component_within_the_tenant(make_tenant, api_client):
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    client = api_client(secret)
    for i, policy in enumerate(["ckpt-a", "ckpt-a", "ckpt-b"]):
        _open(client, **{**FULL, "policy_checkpoint": policy, "attempt_id": f"att-{i}"})
    _open(client, attempt_id="att-9")  # everything unknown
    _open(api_client(other_secret), **FULL)  # another tenant's: never counted

    listed = client.get("/api/v1/episodes?provenance.policy=ckpt-a").json()
    assert listed["count"] == 2
    assert {e["provenance"]["components"]["policy"] for e in listed["results"]} == {"ckpt-a"}
    assert client.get("/api/v1/episodes?provenance.policy=ckpt-a,ckpt-b").json()["count"] == 3
    assert client.get("/api/v1/episodes?provenance.task=unknown").json()["count"] == 1
    origin = listed["results"][0]["provenance"]["origin"]
    assert client.get(f"/api/v1/episodes?provenance_origin={origin}").json()["count"] == 2

    bad = client.get("/api/v1/episodes?provenance.colour=red")
    assert bad.status_code == 400
    assert bad.json()["error"]["field"] == "provenance.colour"

    grouped = client.get("/api/v1/episodes/provenance?group_by=policy,harness").json()
    counts = {
        (g["components"]["policy"], g["components"]["harness"]): g["episodes"]
        for g in grouped["groups"]
    }
    assert counts == {("ckpt-a", "h-1111"): 2, ("ckpt-b", "h-1111"): 1, ("unknown", "unknown"): 1}
    by_origin = client.get("/api/v1/episodes/provenance?group_by=origin").json()["groups"]
    assert sorted(g["episodes"] for g in by_origin) == [1, 1, 2]
    filtered = client.get(
        "/api/v1/episodes/provenance?group_by=attempt&provenance.policy=ckpt-b"
    ).json()
    assert filtered["groups"] == [
        {"components": {"attempt": "att-2"}, "episodes": 1, "closed": 0, "valid": 0, "successes": 0}
    ]
    refused = client.get("/api/v1/episodes/provenance?group_by=colour")
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "group_by"
    assert client.get("/api/v1/episodes/provenance").status_code == 400


def test_the_backfill_computes_keys_for_existing_rows(make_tenant):
    tenant, _ = make_tenant()
    old = Episode.objects.create(
        tenant=tenant,
        task_id="t",
        attempt_id="att-old",
        policy_version="step-5",
        image_digest="sha256:img-old",
        sampling={"temperature": 1},
    )
    assert old.provenance_key == ""  # rows written before provenance existed
    migration = importlib.import_module(
        "apps.trajectories.migrations.0006_backfill_provenance_keys"
    )
    migration.backfill(django_apps, None)
    old.refresh_from_db()
    sampling = hashlib.sha256(b'{"temperature":1}').hexdigest()[:16]
    parts = [
        ("task", "unknown"),
        ("image", "sha256:img-old"),
        ("snapshot", "none"),
        ("policy", "step-5"),
        ("harness", "unknown"),
        ("verifier", "unknown"),
        ("sampling", f"sha256:{sampling}"),
        ("attempt", "att-old"),
    ]
    assert old.provenance == dict(parts)
    assert old.provenance_key == _hand_key(parts)
    assert old.provenance_origin == _hand_key(parts[:-1])


def test_an_import_keeps_the_exporters_components_and_recomputes_the_keys(make_tenant, api_client):
    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    source = api_client(secret)
    snapshot_parent = make_sandbox(tenant)
    snap = _snapshot(tenant, snapshot_parent)
    child = make_sandbox(tenant, snapshot=snap, ready_at=timezone.now())
    ep = _open(source, sandbox_ids=[child.external_id], **FULL)
    exported = b"".join(source.get("/api/v1/episodes/export").streaming_content)
    record = json.loads(exported)
    assert record["provenance"]["components"]["snapshot"] == str(snap.pk)
    record["provenance"]["key"] = "hp1:forged"  # a line's key is never trusted
    target = api_client(other_secret)
    body = json.dumps(record).encode()
    response = target.generic("POST", "/api/v1/episodes/import", body, content_type="x")
    assert response.status_code == 200, response.content
    imported = target.get(f"/api/v1/episodes/{ep['id']}").json()
    assert imported["provenance"]["components"] == ep["provenance"]["components"]
    assert imported["provenance"]["key"] == ep["provenance"]["key"]
