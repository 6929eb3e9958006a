"""Reversible lineage: raw events as received, versioned normalized / segment / packed
layers that keep their predecessors, a trace from any packed sample down to raw events,
and a deletion request that finds everything derived (layers, exports, registered
dependents) through the lineage and leaves a tombstone."""

from __future__ import annotations

from typing import Any

import pytest

from apps.tenancy.services import api_key_create
from apps.trajectories import lineage_registry
from apps.trajectories.models import (
    Episode,
    EpisodeSecret,
    LayerItem,
    LineageExport,
    LineageLayer,
    RawEvent,
    Tombstone,
)

pytestmark = pytest.mark.django_db
GITHUB = "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"


def _recorded(client: Any, task_id: str = "t-1", **labels: str) -> str:
    ep = client.post(
        "/api/v1/episodes", {"task_id": task_id, "labels": labels}, format="json"
    ).json()
    path = f"/api/v1/episodes/{ep['id']}"
    first = {"steps": [{"kind": "model", "action": "think"}, {"kind": "tool", "action": "ls"}]}
    assert client.post(f"{path}/steps", first, format="json").status_code == 201
    second = {"steps": [{"kind": "model", "action": f"done {GITHUB}"}]}
    assert client.post(f"{path}/steps", second, format="json").status_code == 201
    closed = client.post(f"{path}/close", {"reward": 1.0}, format="json")
    assert closed.status_code == 200
    return str(ep["id"])


def _layers(client: Any, episode_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/api/v1/episodes/{episode_id}/lineage")
    assert response.status_code == 200
    layers: list[dict[str, Any]] = response.json()["layers"]
    return layers


def _post_layer(client: Any, episode_id: str, body: dict[str, Any]) -> Any:
    return client.post(f"/api/v1/episodes/{episode_id}/layers", body, format="json")


def test_raw_events_are_kept_as_received_and_normalized_steps_name_them(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    episode_id = _recorded(client)
    raw = client.get(f"/api/v1/episodes/{episode_id}/raw-events").json()["results"]
    assert [(e["seq"], e["kind"], e["produced"]) for e in raw] == [
        (0, "open", []),
        (1, "steps", [0, 1]),
        (2, "steps", [2]),
        (3, "close", []),
    ]
    assert raw[1]["body"] == {
        "steps": [{"kind": "model", "action": "think"}, {"kind": "tool", "action": "ls"}]
    }  # what the harness sent, not what the server made of it
    assert GITHUB not in str(raw) and "<SECRET:github_token:" in str(raw[2]["body"])

    (layer,) = _layers(client, episode_id)
    assert (layer["kind"], layer["version"], layer["producer"], layer["producer_version"]) == (
        "normalized",
        1,
        "hedgerow.steps",
        "1",
    )
    assert layer["schema_version"] == "hedgerow.episode/v1" and layer["items"] == 3
    items = client.get(f"/api/v1/episodes/{episode_id}/layers/{layer['id']}").json()["results"]
    assert [(i["position"], i["sources"], i["data"]["action"]) for i in items][:2] == [
        (0, [1], "think"),
        (1, [1], "ls"),
    ]
    assert items[2]["sources"] == [2]


def test_a_new_parser_version_is_a_new_layer_and_the_old_one_stays(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    episode_id = _recorded(client)
    (v1,) = _layers(client, episode_id)
    mine = _post_layer(
        client,
        episode_id,
        {
            "kind": "normalized",
            "producer": "my-parser",
            "producer_version": "2",
            "schema_version": "tool-calls/1",
            "items": [{"raw_events": [1], "data": {"calls": 2}}, {"raw_events": [2], "data": {}}],
        },
    )
    assert mine.status_code == 201, mine.content
    assert mine.json()["version"] == 2 and mine.json()["items"] == 2
    again = _post_layer(
        client,
        episode_id,
        {"kind": "normalized", "parser": "hedgerow.steps", "parser_version": "1"},
    )
    assert again.status_code == 201 and again.json()["version"] == 3
    layers = _layers(client, episode_id)
    assert [(la["version"], la["producer"]) for la in layers] == [
        (1, "hedgerow.steps"),
        (2, "my-parser"),
        (3, "hedgerow.steps"),
    ]
    old = client.get(f"/api/v1/episodes/{episode_id}/layers/{v1['id']}").json()
    assert len(old["results"]) == 3  # untouched

    unknown = _post_layer(
        client, episode_id, {"kind": "normalized", "parser": "magic", "parser_version": "9"}
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "parser"
    bad_source = _post_layer(
        client,
        episode_id,
        {"kind": "normalized", "producer": "p", "producer_version": "1",
         "items": [{"raw_events": [99]}]},
    )  # fmt: skip
    assert bad_source.status_code == 400
    assert LineageLayer.objects.filter(episode__episode_id=episode_id).count() == 3


def test_segments_and_packed_samples_trace_back_to_raw_events(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    episode_id = _recorded(client)
    (normalized,) = _layers(client, episode_id)
    segments_body = {
        "kind": "segments",
        "source_layer": normalized["id"],
        "producer": "credit-selector",
        "producer_version": "0.3",
        "items": [
            {"steps": [0, 1], "reason": "tool use that passed", "evidence": {"verifier": "pass"},
             "reward": 1.0},
            {"steps": [2, 2], "reason": "final answer", "reward": 0.5},
        ],
    }  # fmt: skip
    for broken, field in [
        ({"steps": [1, 5], "reason": "x"}, "items[0]"),
        ({"steps": [0, 1]}, "items[0].reason"),
        ({"steps": [2, 1], "reason": "x"}, "items[0].steps"),
        ({"steps": [0, 1], "reason": "x", "reward": "high"}, "items[0].reward"),
    ]:
        refused = _post_layer(client, episode_id, {**segments_body, "items": [broken]})
        assert refused.status_code == 400, broken
        assert refused.json()["error"]["field"] == field
    assert LineageLayer.objects.filter(kind="segments").count() == 0  # nothing half-made

    segments = _post_layer(client, episode_id, segments_body)
    assert segments.status_code == 201, segments.content
    packed_body = {
        "kind": "packed",
        "source_layer": segments.json()["id"],
        "producer": "packer",
        "producer_version": "1",
        "params": {"tokenizer": "tok-llama3@abc", "chat_template": "tmpl-7"},
        "items": [{"segments": [0], "data": {"input_ids": [1, 2, 3]}}],
    }
    no_tokenizer = _post_layer(client, episode_id, {**packed_body, "params": {}})
    assert no_tokenizer.status_code == 400
    assert no_tokenizer.json()["error"]["field"] == "params.tokenizer"
    wrong_source = _post_layer(
        client, episode_id, {**packed_body, "source_layer": normalized["id"]}
    )
    assert wrong_source.status_code == 400
    packed = _post_layer(client, episode_id, packed_body)
    assert packed.status_code == 201, packed.content
    assert packed.json()["params"]["chat_template"] == "tmpl-7"

    trace = client.get(f"/api/v1/episodes/{episode_id}/layers/{packed.json()['id']}/items/0/trace")
    assert trace.status_code == 200
    body = trace.json()
    assert [level["layer"]["kind"] for level in body["levels"]] == [
        "packed",
        "segments",
        "normalized",
    ]
    assert body["levels"][1]["items"] == [
        {
            "position": 0,
            "sources": [0, 1],
            "data": None,
            "reason": "tool use that passed",
            "evidence": {"verifier": "pass"},
            "reward": 1.0,
        }
    ]
    assert [i["data"]["action"] for i in body["levels"][2]["items"]] == ["think", "ls"]
    assert [(e["seq"], e["kind"]) for e in body["raw_events"]] == [(1, "steps")]
    assert body["raw_events"][0]["body"]["steps"][1]["action"] == "ls"
    missing = client.get(
        f"/api/v1/episodes/{episode_id}/layers/{packed.json()['id']}/items/7/trace"
    )
    assert missing.status_code == 404


def test_another_tenant_sees_no_lineage(make_tenant, api_client):
    _, secret = make_tenant()
    _, other = make_tenant()
    client = api_client(secret)
    episode_id = _recorded(client)
    (layer,) = _layers(client, episode_id)
    outsider = api_client(other)
    for path in (
        "lineage",
        "raw-events",
        f"layers/{layer['id']}",
        f"layers/{layer['id']}/items/0/trace",
    ):
        assert outsider.get(f"/api/v1/episodes/{episode_id}/{path}").status_code == 404
    body = {"kind": "normalized", "parser": "hedgerow.steps", "parser_version": "1"}
    assert _post_layer(outsider, episode_id, body).status_code == 404
    assert (
        outsider.post(
            "/api/v1/lineage/withdrawals",
            {"episode_ids": [episode_id], "reason": "x"},
            format="json",
        ).status_code
        == 404
    )
    assert Episode.objects.filter(episode_id=episode_id).exists()


def test_a_withdrawn_task_removes_everything_derived_and_leaves_a_tombstone(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    other_tenant, other_secret = make_tenant()
    client = api_client(secret)
    gone = [_recorded(client, "t-withdrawn"), _recorded(client, "t-withdrawn")]
    kept = _recorded(client, "t-kept")
    elsewhere = _recorded(api_client(other_secret), "t-withdrawn")  # another tenant's
    (normalized,) = _layers(client, gone[0])
    segments = _post_layer(
        client,
        gone[0],
        {"kind": "segments", "source_layer": normalized["id"], "producer": "s",
         "producer_version": "1", "items": [{"steps": [0, 2], "reason": "all"}]},
    ).json()  # fmt: skip
    _post_layer(
        client,
        gone[0],
        {"kind": "packed", "source_layer": segments["id"], "producer": "p",
         "producer_version": "1", "params": {"tokenizer": "t", "chat_template": "c"},
         "items": [{"segments": [0]}]},
    )  # fmt: skip
    exported = b"".join(client.get("/api/v1/episodes/export?task=t-withdrawn").streaming_content)
    assert exported.count(b"\n") == 2
    export_row = LineageExport.objects.get(tenant=tenant)
    assert sorted(export_row.episode_ids) == sorted(gone)

    seen: list[lineage_registry.Withdrawal] = []

    def datasets(w: lineage_registry.Withdrawal) -> list[dict[str, Any]]:
        seen.append(w)
        return [{"kind": "dataset", "id": "ds-1", "action": "stale"}]

    lineage_registry.register_dependent("test-datasets", datasets)
    try:
        writer = api_client(
            api_key_create(tenant=tenant, name="w", scopes=["read", "write"]).secret
        )
        body = {"task_id": "t-withdrawn", "reason": "licence withdrawn upstream"}
        assert writer.post("/api/v1/lineage/withdrawals", body, format="json").status_code == 403
        both = {**body, "label": "a=b"}
        assert client.post("/api/v1/lineage/withdrawals", both, format="json").status_code == 400
        response = client.post("/api/v1/lineage/withdrawals", body, format="json")
    finally:
        lineage_registry.unregister_dependent("test-datasets")
    assert response.status_code == 201, response.content
    tombstone = response.json()
    removed = tombstone["removed"]
    assert sorted(e["episode_id"] for e in removed["episodes"]) == sorted(gone)
    assert all(e["provenance_key"].startswith("hp1:") for e in removed["episodes"])
    assert removed["raw_events"] == 8  # open, two step batches, close — twice
    assert sorted((la["kind"], la["episode_id"]) for la in removed["layers"]) == sorted(
        [("normalized", gone[0]), ("segments", gone[0]), ("packed", gone[0]),
         ("normalized", gone[1])]
    )  # fmt: skip
    assert removed["items"] == 3 + 1 + 1 + 3
    affects = tombstone["affects"]
    assert {"kind": "export", "id": export_row.pk} == {k: affects[0][k] for k in ("kind", "id")}
    assert sorted(affects[0]["episodes"]) == sorted(gone)
    assert {"dependent": "test-datasets", "kind": "dataset", "id": "ds-1", "action": "stale"} in (
        affects
    )
    assert len(seen) == 1 and sorted(seen[0].episode_ids) == sorted(gone)
    assert len(seen[0].layer_ids) == 4

    assert not Episode.objects.filter(episode_id__in=gone).exists()
    assert not RawEvent.objects.filter(episode__episode_id__in=gone).exists()
    assert not LayerItem.objects.filter(layer__episode__episode_id__in=gone).exists()
    assert not EpisodeSecret.objects.filter(episode__episode_id__in=gone).exists()
    assert Episode.objects.filter(episode_id=kept).exists()
    assert Episode.objects.filter(tenant=other_tenant, episode_id=elsewhere).exists()
    assert Tombstone.objects.filter(tenant=tenant).count() == 1
    listed = client.get("/api/v1/lineage/tombstones").json()["results"]
    assert [t["id"] for t in listed] == [tombstone["id"]]
    assert api_client(other_secret).get("/api/v1/lineage/tombstones").json()["results"] == []
    again = client.post("/api/v1/lineage/withdrawals", body, format="json")
    assert again.status_code == 404  # nothing left to delete


def test_a_failing_dependent_aborts_the_deletion(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    episode_id = _recorded(client)

    def broken(w: lineage_registry.Withdrawal) -> list[dict[str, Any]]:
        raise RuntimeError("datasets unavailable")

    lineage_registry.register_dependent("broken", broken)
    try:
        response = client.post(
            "/api/v1/lineage/withdrawals",
            {"episode_ids": [episode_id], "reason": "r"},
            format="json",
        )
        assert response.status_code == 500
    finally:
        lineage_registry.unregister_dependent("broken")
    assert Episode.objects.filter(episode_id=episode_id).exists()
    assert not Tombstone.objects.exists()


def test_a_withdrawn_source_is_found_by_its_label(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    from_source = _recorded(client, "t-1", source="vendor-a")
    other_source = _recorded(client, "t-1", source="vendor-b")
    response = client.post(
        "/api/v1/lineage/withdrawals",
        {"label": "source=vendor-a", "reason": "vendor withdrew consent"},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert [e["episode_id"] for e in response.json()["removed"]["episodes"]] == [from_source]
    assert response.json()["request"] == {"label": "source=vendor-a"}
    assert not Episode.objects.filter(episode_id=from_source).exists()
    assert Episode.objects.filter(episode_id=other_source).exists()
    bad = client.post(
        "/api/v1/lineage/withdrawals", {"label": "no-equals", "reason": "x"}, format="json"
    )
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "label"
    blank = client.post(
        "/api/v1/lineage/withdrawals", {"task_id": "t-1", "reason": "  "}, format="json"
    )
    assert blank.status_code == 400 and blank.json()["error"]["field"] == "reason"
    assert Episode.objects.filter(episode_id=other_source).exists()
