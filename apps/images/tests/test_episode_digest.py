"""Episodes record exactly which image their sandboxes ran: the digest comes from the
linked sandbox (unless the client gave one) and the JSONL export carries it."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode

pytestmark = pytest.mark.django_db
DIGEST = "sha256:" + "ab" * 32


def test_an_episode_takes_its_sandboxs_image_digest_into_the_export(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = make_sandbox(
        tenant, image="127.0.0.1:5000/team/app:v1", image_digest=DIGEST, ready_at=timezone.now()
    )
    episode = client.post(
        "/api/v1/episodes",
        {"task_id": "t-1", "image": sandbox.image, "sandbox_ids": [sandbox.external_id]},
        format="json",
    )
    assert episode.status_code == 201, episode.content
    assert episode.json()["image_digest"] == DIGEST
    assert Episode.objects.get(episode_id=episode.json()["id"]).image_digest == DIGEST
    response = client.get("/api/v1/episodes/export")
    record = json.loads(b"".join(response.streaming_content))
    assert record["image_digest"] == DIGEST


def test_a_digest_the_client_recorded_is_kept(make_tenant, api_client):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, image_digest=DIGEST, ready_at=timezone.now())
    mine = "sha256:" + "cd" * 32
    episode = api_client(secret).post(
        "/api/v1/episodes",
        {"task_id": "t-1", "image_digest": mine, "sandbox_ids": [sandbox.external_id]},
        format="json",
    )
    assert episode.status_code == 201, episode.content
    assert Episode.objects.get(episode_id=episode.json()["id"]).image_digest == mine


def test_a_host_sandbox_leaves_the_digest_empty(make_tenant, api_client):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, ready_at=timezone.now())
    episode = api_client(secret).post(
        "/api/v1/episodes", {"task_id": "t-1", "sandbox_ids": [sandbox.external_id]}, format="json"
    )
    assert episode.status_code == 201, episode.content
    assert Episode.objects.get(episode_id=episode.json()["id"]).image_digest == ""
