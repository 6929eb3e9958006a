"""Labels edited after create (PATCH, a merge patch) and the sandbox list's filters and
cursor pages (issue 26: "labels editable after create, list with label filters and
pagination")."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox


@pytest.mark.django_db
def test_a_label_patch_sets_removes_and_keeps_and_is_recorded(make_tenant, api_client):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, labels={"run": "r1", "stage": "train", "keep": "yes"})
    api = api_client(secret)
    url = f"/api/v1/sandboxes/{sandbox.external_id}"
    response = api.patch(url, {"labels": {"run": "r2", "stage": None, "new": "x"}}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["labels"] == {"run": "r2", "keep": "yes", "new": "x"}
    sandbox.refresh_from_db()
    assert sandbox.labels == {"run": "r2", "keep": "yes", "new": "x"}
    event = SandboxEvent.objects.get(sandbox=sandbox, event="labels_changed")
    assert json.loads(event.message) == {"set": ["new", "run"], "removed": ["stage"]}
    assert event.actor  # who changed them
    # The same patch again changes nothing and records nothing.
    assert api.patch(url, {"labels": {"run": "r2"}}, format="json").status_code == 200
    assert SandboxEvent.objects.filter(event="labels_changed").count() == 1
    # Removing a label that is not there is fine; an empty patch is no change.
    assert api.patch(url, {"labels": {"absent": None}}, format="json").status_code == 200
    assert api.patch(url, {"labels": {}}, format="json").json()["labels"] == sandbox.labels


@pytest.mark.django_db
def test_a_bad_label_patch_changes_nothing_not_even_the_egress(make_tenant, api_client):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, labels={f"k{i}": "v" for i in range(31)})
    api = api_client(secret)
    url = f"/api/v1/sandboxes/{sandbox.external_id}"
    cases = [
        {"labels": {"a": "1", "b": "2"}},  # 33 labels
        {"labels": {"bad key!": "v"}},
        {"labels": {"k0": 7}},
        {"labels": {"k0": "x" * 254}},
        {"labels": ["k0"]},
        {"labels": {"bad key!": None}},
        {"labels": {"a": "1", "b": "2"}, "egress": "all"},
    ]
    for body in cases:
        response = api.patch(url, body, format="json")
        assert response.status_code == 400, (body, response.content)
        error = response.json()["error"]
        assert (error["code"], error["field"]) == ("validation_error", "labels"), body
    sandbox.refresh_from_db()
    assert sandbox.labels == {f"k{i}": "v" for i in range(31)}
    assert sandbox.egress == "none"
    assert not SandboxEvent.objects.exists()
    # One more is allowed (32), replacing as it removes is too.
    ok = api.patch(url, {"labels": {"a": "1"}}, format="json")
    assert ok.status_code == 200 and len(ok.json()["labels"]) == 32
    swap = api.patch(url, {"labels": {"b": "2", "a": None}}, format="json")
    assert swap.status_code == 200 and "b" in swap.json()["labels"]


@pytest.mark.django_db
def test_labels_of_another_team_or_an_ended_sandbox_cannot_change(make_tenant, api_client):
    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    sandbox = make_sandbox(tenant, labels={"run": "r1"})
    url = f"/api/v1/sandboxes/{sandbox.external_id}"
    hidden = api_client(other_secret).patch(url, {"labels": {"run": "x"}}, format="json")
    assert hidden.status_code == 404
    assert hidden.json()["error"]["code"] == "sandbox_not_found"
    gone = make_sandbox(tenant, state=State.DELETED, labels={"run": "r0"})
    ended = api_client(secret).patch(
        f"/api/v1/sandboxes/{gone.external_id}", {"labels": {"run": "x"}}, format="json"
    )
    assert ended.status_code == 409
    assert ended.json()["error"]["code"] == "sandbox_ended"
    # A provisioning sandbox's labels can change (labels are not the egress).
    busy = make_sandbox(tenant, state=State.PROVISIONING)
    changed = api_client(secret).patch(
        f"/api/v1/sandboxes/{busy.external_id}", {"labels": {"run": "x"}}, format="json"
    )
    assert changed.status_code == 200
    sandbox.refresh_from_db()
    gone.refresh_from_db()
    assert (sandbox.labels, gone.labels) == ({"run": "r1"}, {"run": "r0"})


def _make_many(tenant, count, **fields):
    """``count`` sandboxes, some sharing a created_at (ties must not break pages)."""
    base = timezone.now() - timedelta(hours=1)
    made = []
    for i in range(count):
        made.append(
            make_sandbox(
                tenant,
                external_id=f"sb-{tenant.slug[-6:]}-{i:03d}",
                created_at=base + timedelta(seconds=i // 3),
                **fields,
            )
        )
    return made


@pytest.mark.django_db
def test_cursor_pages_cover_every_sandbox_once_while_others_come_and_go(make_tenant, api_client):
    tenant, secret = make_tenant()
    made = _make_many(tenant, 23)
    api = api_client(secret)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 5, "state": "ready", **({"cursor": cursor} if cursor else {})}
        with CaptureQueriesContext(connection) as queries:
            body = api.get("/api/v1/sandboxes", params).json()
        counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
        if pages == 0:
            assert body["count"] == 23 and len(counts) == 1
        else:
            # Counted once per listing, not once per page: a cursor page has no count.
            assert body["count"] is None and counts == [], counts
        seen.extend(item["id"] for item in body["results"])
        pages += 1
        if pages == 2:
            # Created and deleted between pages: neither repeats nor hides another.
            make_sandbox(tenant, external_id="sb-new-one")
            Sandbox.objects.filter(pk=made[0].pk).update(state=State.DELETED)
        cursor = body["next_cursor"]
        if cursor is None:
            assert body["next"] is None
            break
        assert f"cursor={cursor}" in body["next"]
    expected = [
        s.external_id for s in sorted(made[1:], key=lambda s: (s.created_at, s.pk), reverse=True)
    ]
    assert seen == expected
    assert pages == 5


@pytest.mark.django_db
def test_list_filters_by_labels_state_and_image_and_refuses_bad_input(make_tenant, api_client):
    tenant, secret = make_tenant()
    other, other_secret = make_tenant()
    a = make_sandbox(tenant, external_id="sb-a", labels={"run": "r1", "gpu": "no"})
    b = make_sandbox(tenant, external_id="sb-b", labels={"run": "r1"})
    make_sandbox(tenant, external_id="sb-c", labels={"run": "r2"})
    make_sandbox(tenant, external_id="sb-d", labels={"run": "r1"}, state=State.DELETED)
    make_sandbox(other, external_id="sb-e", labels={"run": "r1"})
    api = api_client(secret)

    def ids(params):
        response = api.get("/api/v1/sandboxes", params)
        assert response.status_code == 200, response.content
        return {item["id"] for item in response.json()["results"]}

    assert ids({"label": "run=r1"}) == {"sb-a", "sb-b", "sb-d"}
    assert ids({"label": ["run=r1", "gpu"], "state": "ready"}) == {a.external_id}
    assert ids({"label": "run=r1", "state": "ready"}) == {a.external_id, b.external_id}
    assert ids({"label": "gpu=yes"}) == set()
    assert ids({"label": "run=r1", "image": "other"}) == set()
    assert {
        i["id"] for i in api_client(other_secret).get("/api/v1/sandboxes").json()["results"]
    } == {"sb-e"}
    for params, field in (
        ({"label": "=x"}, "label"),
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
    ):
        response = api.get("/api/v1/sandboxes", params)
        assert response.status_code == 400, (params, response.content)
        assert response.json()["error"]["field"] == field
    # The older offset paging still answers as it did.
    legacy = api.get("/api/v1/sandboxes", {"limit": 2, "offset": 1}).json()
    assert legacy["count"] == 4 and len(legacy["results"]) == 2 and "next_cursor" not in legacy


@pytest.mark.django_db
def test_a_first_page_that_is_also_the_last_counts_its_rows_without_a_count_query(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    _make_many(tenant, 3)
    with CaptureQueriesContext(connection) as queries:
        body = api_client(secret).get("/api/v1/sandboxes", {"limit": 5}).json()
    assert body["count"] == 3 and len(body["results"]) == 3 and body["next_cursor"] is None
    assert not [q for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    # Exactly full: one page, the next cursor None, still its own count.
    body = api_client(secret).get("/api/v1/sandboxes", {"limit": 3}).json()
    assert body["count"] == 3 and body["next_cursor"] is None
