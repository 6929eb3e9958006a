"""The episode list API pages by cursor (issue 20): a walk returns every episode of the
team exactly once — also episodes that started in the same instant, and one opened
between two pages — never another team's, and a bad cursor is a 400."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.trajectories.models import Episode
from apps.trajectories.services.episodes import episode_open

pytestmark = pytest.mark.django_db


def _open(tenant: Any, task: str) -> str:
    episode, _ = episode_open(tenant=tenant, actor="t", fields={"task_id": task}, sandbox_ids=[])
    return str(episode.episode_id)


def test_a_cursor_walk_returns_every_episode_once(make_tenant, api_client):
    tenant, secret = make_tenant()
    other, _ = make_tenant()
    mine = {_open(tenant, f"t{i}") for i in range(11)}
    theirs = {_open(other, "x") for _ in range(3)}
    # four of them started in the same instant: the id breaks the tie
    same = timezone.now().replace(microsecond=0)
    Episode.objects.filter(episode_id__in=sorted(mine)[:4]).update(started_at=same)
    api = api_client(secret)
    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        with CaptureQueriesContext(connection) as queries:
            body = api.get("/api/v1/episodes", {"limit": 3, "cursor": cursor}).json()
        assert "count" not in body  # a cursor page counts nothing
        assert not [q for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
        seen += [e["id"] for e in body["results"]]
        pages += 1
        if pages == 2:
            # opened between two pages: newer than the cursor, so on no later page
            _open(tenant, "late")
        cursor = body["next_cursor"]
        if cursor is None:
            break
        assert len(body["results"]) == 3
    assert len(seen) == len(set(seen)) == 11
    assert set(seen) == mine and not set(seen) & theirs
    assert pages == 4


def test_a_cursor_the_server_did_not_give_is_a_400(make_tenant, api_client):
    tenant, secret = make_tenant()
    _open(tenant, "a")
    api = api_client(secret)
    for bad in ("not-a-cursor", "MjAyNi0wMS0wMXxub3BlCg"):
        response = api.get("/api/v1/episodes", {"cursor": bad})
        assert response.status_code == 400, response.content
        assert response.json()["error"]["field"] == "cursor"
    assert api.get("/api/v1/episodes", {"cursor": "", "limit": 0}).status_code == 400
    # the offset pages stay as they were
    legacy = api.get("/api/v1/episodes", {"limit": 1, "offset": 0}).json()
    assert legacy["count"] == 1 and "next_cursor" not in legacy


def test_an_episodes_steps_page_in_order_every_step_once(make_tenant, api_client):
    from apps.trajectories.models import Step

    tenant, secret = make_tenant()
    other, other_secret = make_tenant()
    episode = Episode.objects.get(episode_id=_open(tenant, "t"))
    Step.objects.bulk_create(Step(episode=episode, index=i, kind="exec") for i in range(11))
    api = api_client(secret)
    url = f"/api/v1/episodes/{episode.episode_id}/steps"
    whole = api.get(url).json()  # 1,000 a page by default: a short episode in one answer
    assert [s["index"] for s in whole["results"]] == list(range(11))
    assert whole["next_cursor"] is None
    seen: list[int] = []
    cursor = ""
    while True:
        body = api.get(url, {"limit": 4, "cursor": cursor}).json()
        seen += [s["index"] for s in body["results"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
        assert len(body["results"]) == 4
    assert seen == list(range(11))
    for bad in ({"cursor": "x1"}, {"limit": "0"}, {"limit": "1001"}):
        response = api.get(url, bad)
        assert response.status_code == 400, bad
        assert response.json()["error"]["field"] == next(iter(bad))
    assert api_client(other_secret).get(url).status_code == 404
