"""Where the time goes (steps + ledger) and the dataset pages, server side."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.datasets.tests.factories import closed_episode
from apps.sandboxes.models import SandboxEvent
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import EpisodeSandbox, Step

pytestmark = pytest.mark.django_db


def _timed_episode(tenant):
    start = timezone.now() - timedelta(minutes=5)
    ep = closed_episode(
        tenant, "timed", "success", started_at=start, ended_at=start + timedelta(seconds=10)
    )
    Step.objects.create(episode=ep, index=0, kind="model", model_call={"latency_s": 2.5})
    Step.objects.create(episode=ep, index=1, kind="exec", duration_s=3.0)
    Step.objects.create(  # no duration: the operation's usage says how long it took
        episode=ep, index=2, kind="tool", observation={"usage": {"wall_s": 0.5}}
    )
    Step.objects.create(
        episode=ep, index=3, kind="verifier", duration_s=1.0, model_call={"latency_s": "fast"}
    )
    sb = make_sandbox(tenant)
    t0 = start - timedelta(seconds=20)
    for offset, state in ((0, "queued"), (4, "requested"), (7, "provisioning"), (11, "ready")):
        SandboxEvent.objects.create(
            sandbox=sb,
            tenant=tenant,
            at=t0 + timedelta(seconds=offset),
            event="transition",
            to_state=state,
            generation=1 if state == "ready" else 0,
        )
    EpisodeSandbox.objects.create(episode=ep, sandbox=sb, sandbox_ref=sb.external_id, generation=1)
    return ep


def test_it_splits_an_episodes_time_by_hand(make_tenant, api_client):
    tenant, secret = make_tenant()
    ep = _timed_episode(tenant)
    client = api_client(secret)
    body = client.get(f"/api/v1/episodes/{ep.episode_id}/time").json()
    # wall 10 s = model 2.5 + environment (3 + 0.5) + verifier 1 + other 3
    assert body["wall_s"] == 10.0
    assert (body["model_s"], body["environment_s"], body["verifier_s"]) == (2.5, 3.5, 1.0)
    assert body["other_s"] == 3.0
    # ledger: queued → requested 4 s, requested → ready 7 s
    assert (body["queue_s"], body["startup_s"]) == (4.0, 7.0)
    closed_episode(tenant, "other", "task")  # no steps: adds only its 5 s of wall time
    agg = client.get("/api/v1/episodes/time").json()
    assert agg["episodes"] == 2
    assert agg["total"]["wall_s"] == 15.0 and agg["total"]["other_s"] == 8.0
    assert agg["share"]["model_s"] == pytest.approx(2.5 / 15)
    only = client.get("/api/v1/episodes/time", {"task": "timed"}).json()
    assert only["episodes"] == 1
    _, other_secret = make_tenant()
    assert api_client(other_secret).get(f"/api/v1/episodes/{ep.episode_id}/time").status_code == 404
    assert api_client(other_secret).get("/api/v1/episodes/time").json()["episodes"] == 0


def _signed_in(make_user, username, *memberships):
    make_user(username, *memberships)
    client = Client()
    assert client.login(username=username, password=username)
    return client


def test_the_pages_show_cards_matrix_time_and_refuse_other_teams(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    ep = _timed_episode(tenant)
    closed_episode(other, "theirs", "success")
    owner = _signed_in(make_user, "dsowner", (tenant, "owner"))
    created = owner.post(
        "/datasets/create",
        {
            "name": "first",
            "group_by": "task",
            "train": "1",
            "validation": "0",
            "test": "0",
            "seed": "0",
        },
    )
    assert created.status_code == 302, created.content
    dataset_url = created["Location"]
    page = owner.get(dataset_url)
    assert page.status_code == 200
    assert b"no group, task or key value in two splits" in page.content
    assert b"episodes held secrets (replaced by placeholders)" in page.content
    listing = owner.get("/datasets/")
    assert b"first" in listing.content and b"No task is quarantined" in listing.content
    bad = owner.post(
        "/datasets/create", {"train": "0.5", "validation": "0", "test": "0"}, follow=True
    )
    assert b"fractions must add up to 1" in bad.content
    matrix = owner.get("/datasets/matrix", {"policies": "p0", "harnesses": "h"})
    assert matrix.status_code == 200 and b"S(\xcf\x80, H)" in matrix.content
    detail = owner.get(f"/trajectories/{ep.episode_id}/")
    assert b"Where the time goes" in detail.content and b'data-time-part="model_s">2.50 s' in (
        detail.content
    )
    assert b'data-time="aggregate"' in owner.get("/trajectories/").content
    stranger = _signed_in(make_user, "dsstranger", (other, "owner"))
    assert stranger.get(dataset_url).status_code == 404
    viewer = _signed_in(make_user, "dsviewer", (tenant, "viewer"))
    assert viewer.post("/datasets/create", {"train": "1"}).status_code == 403
