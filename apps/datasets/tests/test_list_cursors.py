"""Lists that grow are paged by cursor (issue 20): the API's tasks, datasets and audits
and the dashboard's datasets returned at most their first 1,000 / 200 / 50 / 100 rows and
dropped the rest without a word. A walk now returns every row of the team exactly once —
rows created in the same instant and one created mid-walk included — never another
team's; a bad cursor or limit is a 400 that names it."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.datasets.models import Dataset, Task
from apps.sandboxes.models import AuditRun
from apps.sandboxes.tests.test_snapshot_image_list_cursor import _walk
from apps.trajectories.models import Tombstone

pytestmark = pytest.mark.django_db


def _task(tenant: Any, i: int) -> str:
    return Task.objects.create(tenant=tenant, task_id=f"repo__issue-{i:04d}").task_id


def _dataset(tenant: Any, i: int) -> str:
    return Dataset.objects.create(tenant=tenant, name=f"d{i}", group_by="task").dataset_id


def _audit(tenant: Any, i: int) -> str:
    now = timezone.now()
    run = AuditRun.objects.create(
        tenant=tenant, period_start=now - timedelta(hours=1), period_end=now
    )
    return str(run.id)


def _tombstone(tenant: Any, i: int) -> str:
    return str(Tombstone.objects.create(tenant=tenant, reason=f"r{i}", actor="test").pk)


KINDS: dict[str, tuple[str, Callable[[Any, int], str], str]] = {
    "tombstones": ("/api/v1/lineage/tombstones", _tombstone, "id"),
    "tasks": ("/api/v1/tasks", _task, "task_id"),
    "datasets": ("/api/v1/datasets", _dataset, "id"),
    "audits": ("/api/v1/audits", _audit, "id"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_cursor_walk_returns_every_row_of_the_team_once(make_tenant, api_client, kind):
    path, make, key = KINDS[kind]
    tenant, secret = make_tenant()
    other, _ = make_tenant()
    mine = {make(tenant, i) for i in range(10)}
    theirs = {make(other, 100 + i) for i in range(2)}
    if kind != "tasks":
        # four created in the same instant: the id breaks the tie
        model: Any
        model, field, time_field = {
            "datasets": (Dataset, "dataset_id", "created_at"),
            "audits": (AuditRun, "id", "created_at"),
            "tombstones": (Tombstone, "id", "at"),
        }[kind]
        model.objects.filter(**{f"{field}__in": sorted(mine)[:4]}).update(
            **{time_field: timezone.now().replace(microsecond=0)}
        )
    late: list[str] = []
    # a row made mid-walk: newest-first lists have it before the cursor (not seen);
    # the task list is by id and this id sorts last, so the walk reaches it
    seen = _walk(
        api_client(secret),
        path,
        lambda page: late.append(make(tenant, 9999)) if page == 2 else None,
        key,
    )
    assert len(seen) == len(set(seen))
    expected = mine | set(late) if kind == "tasks" else mine
    assert set(seen) == expected and not set(seen) & theirs
    if kind == "tasks":
        assert seen == sorted(seen)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_answer_still_holds_a_small_list_whole(make_tenant, api_client, kind):
    # a client that never read next_cursor saw the whole list when it was small: it still does
    path, make, key = KINDS[kind]
    tenant, secret = make_tenant()
    mine = {make(tenant, i) for i in range(7)}
    body = api_client(secret).get(path).json()
    assert {str(row[key]) for row in body["results"]} == mine
    assert body["next_cursor"] is None


def test_the_task_list_pages_past_a_thousand(make_tenant, api_client):
    tenant, secret = make_tenant()
    Task.objects.bulk_create([Task(tenant=tenant, task_id=f"t{i:05d}") for i in range(1003)])
    api = api_client(secret)
    first = api.get("/api/v1/tasks").json()
    assert len(first["results"]) == 1000 and first["next_cursor"]
    rest = api.get("/api/v1/tasks", {"cursor": first["next_cursor"]}).json()
    assert [r["task_id"] for r in rest["results"]] == ["t01000", "t01001", "t01002"]
    assert rest["next_cursor"] is None


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bad_cursor_or_limit_is_a_400_naming_it(make_tenant, api_client, kind):
    path, make, _ = KINDS[kind]
    tenant, secret = make_tenant()
    make(tenant, 1)
    api = api_client(secret)
    bad = "not-a-cursor" if kind != "tasks" else "%%%"
    response = api.get(path, {"cursor": bad})
    assert response.status_code == 400 and response.json()["error"]["field"] == "cursor"
    for limit in ("0", "abc", "100000"):
        response = api.get(path, {"limit": limit})
        assert response.status_code == 400 and response.json()["error"]["field"] == "limit"


def test_a_uuid_cursor_on_a_list_of_integer_ids_is_a_400(make_tenant, api_client):
    # the audits' ids are integers: a cursor of a UUID-keyed list (a snapshot page's) must
    # not reach the query as a UUID, which would be a 500
    from apps.core.keyset import encode_cursor

    tenant, secret = make_tenant()
    _audit(tenant, 1)
    cursor = encode_cursor(timezone.now(), "2f1f7a62-43a1-4c41-9a55-0d5c1a0c7f11")
    response = api_client(secret).get("/api/v1/audits", {"cursor": cursor})
    assert response.status_code == 400 and response.json()["error"]["field"] == "cursor"


def test_the_dashboard_dataset_list_walks_every_dataset_once(make_tenant, make_user, client):
    from apps.datasets.views import DATASETS_PAGE

    tenant, _ = make_tenant()
    other, _ = make_tenant()
    mine = {_dataset(tenant, i) for i in range(DATASETS_PAGE + 7)}
    _dataset(other, 1)
    client.force_login(make_user("dana", (tenant, "owner")))
    seen: list[str] = []
    url: str | None = "/datasets/"
    while url:
        page = client.get(url)
        assert page.status_code == 200
        html = page.content.decode()
        seen += re.findall(r'data-dataset-id="([^"]+)"', html)
        nxt = re.search(r'href="([^"]+)" rel="next"', html)
        url = nxt.group(1).replace("&amp;", "&") if nxt else None
    assert len(seen) == len(set(seen)) == len(mine) and set(seen) == mine
