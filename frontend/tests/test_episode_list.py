"""The Episodes list (issue 24 defect 3, "other long lists"): it stopped at the newest
100 rows. Now cursor pages reach every episode once in either order, search finds an
episode by id (prefix, with or without ``ep-``) or label value, the page links keep the
filters, and another team's episodes never appear."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.trajectories.models import Episode

pytestmark = pytest.mark.django_db


def _signed_in(make_user, username: str, *memberships) -> Client:
    make_user(username, *memberships)
    client = Client()
    assert client.login(username=username, password=username)
    return client


def _episode(tenant, episode_id: str, minutes_ago: int, **fields) -> Episode:
    return Episode.objects.create(
        tenant=tenant,
        episode_id=episode_id,
        task_id=fields.pop("task_id", "task-a"),
        status="closed",
        started_at=timezone.now() - timedelta(minutes=minutes_ago),
        **fields,
    )


def _ids(html: str) -> list[str]:
    return re.findall(r'<tr data-episode-id="([^"]+)"', html)


def _walk(client: Client, url: str) -> tuple[list[str], int]:
    seen: list[str] = []
    pages = 0
    while url:
        response = client.get(url)
        assert response.status_code == 200
        html = response.content.decode()
        seen += _ids(html)
        pages += 1
        match = re.search(r'<a class="btn btn-sm" href="(\?[^"]*cursor=[^"]+)" rel="next"', html)
        url = "/trajectories/" + match.group(1).replace("&amp;", "&") if match else ""
    return seen, pages


def test_cursor_pages_reach_every_episode_once_in_both_orders(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    client = _signed_in(make_user, "eplister", (tenant, "member"))
    made = [_episode(tenant, f"ep-{i:04d}aa", minutes_ago=i).episode_id for i in range(120)]
    _episode(other, "ep-9999aa", minutes_ago=0)
    first = client.get("/trajectories/").content.decode()
    assert len(_ids(first)) == 50 and "ep-9999aa" not in first
    assert 'rel="next"' in first and "First page" not in first
    newest, pages = _walk(client, "/trajectories/")
    assert newest == made and pages == 3  # 50 + 50 + 20, each row once
    oldest, pages = _walk(client, "/trajectories/?sort=oldest")
    assert oldest == list(reversed(made)) and pages == 3
    # a second page links back to the first; a bad cursor starts over, not a 500
    second = client.get("/trajectories/?cursor=not-a-cursor").content.decode()
    assert _ids(second)[:1] == [made[0]]


def test_search_by_id_or_label_and_page_links_keep_the_filters(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "epsearch", (tenant, "member"))
    for i in range(60):
        _episode(tenant, f"ep-b{i:03d}", minutes_ago=i, task_id="task-b", labels={"run": "r7"})
    _episode(tenant, "ep-c001", minutes_ago=100, task_id="task-c", labels={"run": "r8"})

    def ids(query: str) -> list[str]:
        return _ids(client.get(f"/trajectories/?{query}").content.decode())

    assert ids("q=ep-c001") == ["ep-c001"]
    assert ids("q=c00") == ["ep-c001"]  # an id prefix without "ep-"
    assert ids("q=r8") == ["ep-c001"]  # a label value
    assert ids("q=nothing-like-this") == []
    # filters and search carry over to the next page
    seen, pages = _walk(client, "/trajectories/?task=task-b&q=r7")
    assert len(seen) == 60 and len(set(seen)) == 60 and pages == 2
    html = client.get("/trajectories/?label=run%3Dr7").content.decode()
    link = re.search(r'href="(\?[^"]*cursor=[^"]+)" rel="next"', html)
    assert link and "label=run%3Dr7" in link.group(1)
    page_two = client.get("/trajectories/" + link.group(1).replace("&amp;", "&")).content.decode()
    assert "First page" in page_two and "ep-c001" not in page_two
