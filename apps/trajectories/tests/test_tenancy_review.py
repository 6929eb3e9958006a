"""Security review of trajectories: every episode endpoint and page against an outsider
(404, nothing changes), read-only keys and viewers change nothing, and an episode can
never point at another team's sandbox or operation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode, EpisodeRelabel, EpisodeSandbox, Step

pytestmark = pytest.mark.django_db

OUTSIDER_CALLS = [
    ("get", "/api/v1/episodes/{id}", None),
    ("get", "/api/v1/episodes/{id}/steps", None),
    ("post", "/api/v1/episodes/{id}/steps", {"steps": [{"kind": "note", "action": "x"}]}),
    ("post", "/api/v1/episodes/{id}/sandboxes", {"sandbox_id": "sb-mine"}),
    ("post", "/api/v1/episodes/{id}/close", {"reward": 1.0, "verifier_outcome": "pass"}),
    ("post", "/api/v1/episodes/{id}/attribute", None),
    ("get", "/api/v1/episodes/{id}/relabel", None),
    ("post", "/api/v1/episodes/{id}/relabel", {"failure_class": "task", "reason": "mine now"}),
    ("get", "/api/v1/episodes/{id}/timeline", None),
    ("get", "/api/v1/episodes/compare?a={id}&b={id}", None),
]


def _episode(client: Any, **body: Any) -> dict[str, Any]:
    response = client.post("/api/v1/episodes", {"task_id": "t-1", **body}, format="json")
    assert response.status_code == 201, response.content
    result: dict[str, Any] = response.json()
    return result


def _snapshot(episode_id: str) -> tuple[Any, ...]:
    ep = Episode.objects.get(episode_id=episode_id)
    return (
        ep.status,
        ep.failure_class,
        ep.reward,
        Step.objects.filter(episode=ep).count(),
        EpisodeSandbox.objects.filter(episode=ep).count(),
        EpisodeRelabel.objects.filter(episode=ep).count(),
    )


@pytest.mark.parametrize(("method", "path", "body"), OUTSIDER_CALLS)
def test_it_answers_404_to_an_outsider_on_every_episode_endpoint(
    make_tenant, api_client, method, path, body
):
    _, secret = make_tenant()
    outsider_tenant, outsider_secret = make_tenant()
    make_sandbox(outsider_tenant, external_id="sb-mine")
    ep = _episode(api_client(secret))
    before = _snapshot(ep["id"])
    response = getattr(api_client(outsider_secret), method)(
        path.format(id=ep["id"]), body, format="json"
    )
    assert response.status_code == 404, response.content
    assert response.json()["error"]["code"] == "episode_not_found"
    assert _snapshot(ep["id"]) == before


def test_it_keeps_stats_and_open_by_id_per_team(make_tenant, api_client):
    owner, secret = make_tenant()
    outsider_tenant, outsider_secret = make_tenant()
    _episode(api_client(secret), episode_id="ep-shared")
    outsider = api_client(outsider_secret)
    assert outsider.get("/api/v1/episodes/stats").json()["episodes"] == 0
    # The same episode_id opens the outsider's own episode, never returns the owner's.
    theirs = _episode(outsider, episode_id="ep-shared", task_id="t-other")
    assert theirs["task_id"] == "t-other"
    assert Episode.objects.filter(episode_id="ep-shared").count() == 2
    assert Episode.objects.get(tenant=owner, episode_id="ep-shared").task_id == "t-1"
    line = {"schema": "hedgerow.episode/v1", "episode_id": "ep-shared", "task_id": "t",
            "started_at": "2026-03-01T00:00:00Z"}  # fmt: skip
    imported = outsider.post(
        "/api/v1/episodes/import", json.dumps(line), content_type="application/x-ndjson"
    )
    assert imported.status_code == 207  # the outsider already has one: its own
    assert Episode.objects.get(tenant=outsider_tenant, episode_id="ep-shared").task_id == "t-other"


def test_it_never_records_another_teams_operation_as_an_observation(make_tenant, api_client):
    owner, _ = make_tenant()
    _, outsider_secret = make_tenant()
    sandbox = make_sandbox(owner, external_id="sb-owner")
    Operation.objects.create(
        tenant=owner, sandbox=sandbox, operation_id="op-owner", generation=1, request={},
        request_hash="x", status=OperationStatus.COMPLETED, stdout={"text": "owner-secret"},
    )  # fmt: skip
    outsider = api_client(outsider_secret)
    ep = _episode(outsider)
    step = {"kind": "exec", "sandbox_id": "sb-owner", "operation_id": "op-owner"}
    response = outsider.post(f"/api/v1/episodes/{ep['id']}/steps", {"steps": [step]}, format="json")
    assert response.status_code == 404, response.content
    assert b"owner-secret" not in response.content
    assert not Step.objects.filter(episode__episode_id=ep["id"]).exists()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/api/v1/episodes", {"task_id": "t"}),
        ("post", "/api/v1/episodes/{id}/steps", {"steps": [{"kind": "note", "action": "x"}]}),
        ("post", "/api/v1/episodes/{id}/close", {"reward": 1.0}),
        ("post", "/api/v1/episodes/{id}/attribute", None),
        ("post", "/api/v1/episodes/{id}/relabel", {"failure_class": "task", "reason": "r"}),
        ("post", "/api/v1/episodes/import", None),
    ],
)
def test_it_refuses_episode_writes_to_a_read_only_key(make_tenant, api_client, method, path, body):
    tenant, secret = make_tenant()
    from apps.tenancy.services import api_key_create

    read_only = api_key_create(tenant=tenant, name="ro", scopes=["read"]).secret
    ep = _episode(api_client(secret))
    before = (_snapshot(ep["id"]), Episode.objects.count())
    response = getattr(api_client(read_only), method)(path.format(id=ep["id"]), body, format="json")
    assert response.status_code == 403, response.content
    assert response.json()["error"]["code"] == "permission_denied"
    assert (_snapshot(ep["id"]), Episode.objects.count()) == before


def test_it_hides_another_teams_episode_pages_and_refuses_viewer_relabels(
    make_tenant, api_client, make_user
):
    owner, secret = make_tenant()
    outsider_team, _ = make_tenant()
    ep = _episode(api_client(secret))
    make_user("outsider", (outsider_team, "owner"))
    make_user("viewer", (owner, "viewer"))
    outsider, viewer = Client(), Client()
    assert outsider.login(username="outsider", password="outsider")
    assert viewer.login(username="viewer", password="viewer")
    before = _snapshot(ep["id"])
    for path in (f"/trajectories/{ep['id']}/", f"/trajectories/compare?a={ep['id']}&b={ep['id']}"):
        assert outsider.get(path).status_code == 404, path
        assert viewer.get(path).status_code == 200, path
    relabel = {"failure_class": "task", "reason": "not yours"}
    assert outsider.post(f"/trajectories/{ep['id']}/relabel", relabel).status_code == 404
    assert viewer.post(f"/trajectories/{ep['id']}/relabel", relabel).status_code == 403
    assert ep["id"].encode() not in outsider.get("/trajectories/").content
    assert _snapshot(ep["id"]) == before
