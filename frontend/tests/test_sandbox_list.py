"""The sandboxes list (issue 24 defect 3): Live by default, search by id or label value,
label filters, sorting, cursor pages that reach every row, and bulk delete that names
its count and never touches another team's sandboxes."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db


def _signed_in(make_user, username: str, *memberships) -> Client:
    make_user(username, *memberships)
    client = Client()
    assert client.login(username=username, password=username)
    return client


def _row(tenant, external_id: str, state: str = "ready", labels=None, minutes_ago: int = 0):
    now = timezone.now()
    sb = Sandbox.objects.create(
        tenant=tenant,
        external_id=external_id,
        state=state,
        image="host",
        cpu_millis=1000,
        memory_mib=512,
        ttl_seconds=600,
        expires_at=now + timedelta(minutes=10 + minutes_ago),
        backend="local",
        labels=labels or {},
    )
    Sandbox.objects.filter(pk=sb.pk).update(created_at=now - timedelta(minutes=minutes_ago))
    return sb


def _ids(html: str) -> list[str]:
    return re.findall(r'<tr data-sandbox-id="([^"]+)"', html)


def test_live_is_the_default_and_all_states_is_one_choice_away(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "lister", (tenant, "member"))
    _row(tenant, "sb-live1")
    _row(tenant, "sb-dead1", state="deleted", minutes_ago=1)
    assert _ids(client.get("/sandboxes/").content.decode()) == ["sb-live1"]
    assert _ids(client.get("/sandboxes/table?state=all").content.decode()) == [
        "sb-live1",
        "sb-dead1",
    ]
    assert _ids(client.get("/sandboxes/table?state=deleted").content.decode()) == ["sb-dead1"]


def test_search_and_label_filters(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "searcher", (tenant, "member"))
    _row(tenant, "sb-abc123", labels={"team": "rl", "seed": "7"})
    _row(tenant, "sb-def456", labels={"team": "eval"}, minutes_ago=1)
    _row(tenant, "sb-abd789", labels={"team": "rl", "seed": "8"}, minutes_ago=2)

    def ids(query: str) -> list[str]:
        return _ids(client.get(f"/sandboxes/table?{query}").content.decode())

    assert ids("q=abc") == ["sb-abc123"]  # an id prefix, without sb-
    assert ids("q=sb-ab") == ["sb-abc123", "sb-abd789"]
    assert ids("q=eval") == ["sb-def456"]  # a label value
    assert ids("label=team%3Drl") == ["sb-abc123", "sb-abd789"]
    assert ids("label=team%3Drl,seed%3D8") == ["sb-abd789"]
    assert ids("q=nothing-like-it") == []
    assert "No sandboxes match" in client.get("/sandboxes/table?q=zzz").content.decode()


def test_cursor_pages_reach_every_row_once_in_each_sort(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "pager", (tenant, "member"))
    made = [_row(tenant, f"sb-p{i:03d}", minutes_ago=i).external_id for i in range(120)]
    for sort, expected in (
        ("newest", made),
        ("oldest", list(reversed(made))),
        # expires_at was set 10 + i minutes ahead: soonest first is the newest here
        ("expiring", made),
    ):
        seen: list[str] = []
        url = f"/sandboxes/?sort={sort}"
        pages = 0
        while url:
            html = client.get(url).content.decode()
            seen += _ids(html)
            pages += 1
            match = re.search(r'<a href="(\?[^"]*cursor=[^"]+)" rel="next"', html)
            url = "/sandboxes/" + match.group(1).replace("&amp;", "&") if match else ""
        assert seen == expected, sort
        assert pages == 3  # 50 + 50 + 20


def test_bulk_delete_names_its_count_and_stays_in_the_team(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    client = _signed_in(make_user, "bulk", (tenant, "member"))
    mine = [_row(tenant, f"sb-bulk{i}").external_id for i in range(3)]
    _row(tenant, "sb-bulkgone", state="deleted")
    _row(other, "sb-theirs")
    page = client.get("/sandboxes/").content.decode()
    assert 'data-confirm="Delete {n} sandboxes?' in page and 'data-confirm-count="ids"' in page
    answer = client.post(
        "/sandboxes/delete",
        {"ids": [*mine[:2], "sb-bulkgone", "sb-theirs"]},
        HTTP_HX_REQUEST="true",
    )
    assert answer.status_code == 200 and answer["HX-Trigger"] == "sandboxes-changed"
    assert answer.content.decode() == (
        "Deleting 2 sandboxes. 2 skipped (not found or already ending)."
    )
    states = dict(Sandbox.objects.values_list("external_id", "state"))
    assert states[mine[0]] != "ready" and states[mine[1]] != "ready"
    assert states[mine[2]] == "ready" and states["sb-theirs"] == "ready"


def test_viewers_cannot_bulk_delete(make_tenant, make_user):
    tenant, _ = make_tenant()
    viewer = _signed_in(make_user, "bulkviewer", (tenant, "viewer"))
    _row(tenant, "sb-v1")
    assert "bulk-delete" not in viewer.get("/sandboxes/").content.decode()
    assert viewer.post("/sandboxes/delete", {"ids": ["sb-v1"]}).status_code == 403
    assert Sandbox.objects.get(external_id="sb-v1").state == "ready"
