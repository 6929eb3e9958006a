"""The team activity log: written by the services that change keys, members, sandboxes
and limits; read through /api/v1/activity (cursor pages) and exported as CSV/JSONL
without secrets; tenant-scoped; purged after the retention period."""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import override_settings
from django.utils import timezone

from apps.tenancy.activity import activity_purge, activity_record
from apps.tenancy.models import Action, Activity, ApiKey, Membership, Role
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db


def _actions(tenant) -> list[str]:
    return list(
        Activity.objects.filter(tenant=tenant).order_by("id").values_list("action", flat=True)
    )


def test_key_changes_are_logged_with_who_did_them_and_no_secret(make_tenant, api_client):
    tenant, secret = make_tenant()
    admin_key = ApiKey.objects.get(tenant=tenant)
    Activity.objects.filter(tenant=tenant).delete()  # the fixture's own key
    http = api_client(secret)
    created = http.post("/api/v1/keys", {"name": "ci", "scopes": ["read"]}, format="json").json()
    http.patch(f"/api/v1/keys/{created['id']}", {"name": "ci-nightly"}, format="json")
    rotated = http.post(f"/api/v1/keys/{created['id']}/rotate", {}, format="json").json()
    http.delete(f"/api/v1/keys/{created['id']}")
    http.delete(f"/api/v1/keys/{created['id']}")  # a repeat revoke is not a second entry
    assert _actions(tenant) == ["key.created", "key.renamed", "key.rotated", "key.revoked"]
    entries = list(Activity.objects.filter(tenant=tenant).order_by("id"))
    assert {e.actor for e in entries} == {f"key:{admin_key.prefix}"}
    assert entries[1].details["old_name"] == "ci" and entries[1].details["new_name"] == "ci-nightly"
    assert entries[2].details["old_prefix"] == created["prefix"]
    dumped = json.dumps([e.details for e in entries]) + "".join(e.target_name for e in entries)
    assert created["secret"] not in dumped and rotated["secret"] not in dumped


def test_member_changes_are_logged(make_tenant, client):
    tenant, _ = make_tenant()
    owner = User.objects.create_user("olga", password="olga")
    membership_set_role(tenant=tenant, user=owner, role=Role.OWNER)
    User.objects.create_user("pete", password="pete")
    client.force_login(owner)
    assert (
        client.post(
            "/members/", {"action": "add", "username": "pete", "role": "member"}
        ).status_code
        == 302
    )
    pete = Membership.objects.get(tenant=tenant, user__username="pete")
    client.post("/members/", {"action": "role", "membership_id": pete.pk, "role": "admin"})
    client.post("/members/", {"action": "remove", "membership_id": pete.pk})
    entries = list(
        Activity.objects.filter(tenant=tenant).exclude(action="key.created").order_by("id")
    )
    assert [(e.actor, e.action, e.target_name) for e in entries] == [
        ("user:olga", "member.added", "pete"),
        ("user:olga", "member.role_changed", "pete"),
        ("user:olga", "member.removed", "pete"),
    ]
    assert entries[1].details == {"old_role": "member", "new_role": "admin"}


def test_a_refused_change_writes_no_entry(make_tenant, client):
    tenant, _ = make_tenant()
    owner = User.objects.create_user("solo", password="solo")
    membership_set_role(tenant=tenant, user=owner, role=Role.OWNER)
    client.force_login(owner)
    mine = Membership.objects.get(tenant=tenant, user=owner)
    # the last owner cannot leave: nothing half-done, nothing logged
    client.post("/members/", {"action": "remove", "membership_id": mine.pk})
    assert Membership.objects.filter(pk=mine.pk).exists()
    assert not Activity.objects.filter(tenant=tenant, action="member.removed").exists()


def _fill(tenant, n: int) -> None:
    for i in range(n):
        activity_record(
            tenant=tenant,
            actor="user:maya",
            action=Action.SANDBOX_DELETED,
            target_type="sandbox",
            target_id=f"sb-{i}",
            target_name=f"sb-{i}",
        )


def test_the_api_pages_by_cursor_filters_and_is_tenant_scoped(make_tenant, api_client):
    tenant, secret = make_tenant()
    other, other_secret = make_tenant()
    _fill(tenant, 7)
    _fill(other, 3)
    http = api_client(secret)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 3, "action": "sandbox.deleted", **({"cursor": cursor} if cursor else {})}
        page = http.get("/api/v1/activity", params)
        assert page.status_code == 200, page.content
        seen += [row["target_id"] for row in page.json()["results"]]
        cursor = page.json()["next_cursor"]
        pages += 1
        if cursor is None:
            break
    assert pages == 3 and seen == [f"sb-{i}" for i in range(6, -1, -1)]
    # another team's entries are not there; their own API sees only theirs
    theirs = api_client(other_secret).get("/api/v1/activity", {"action": "sandbox.deleted"})
    assert [r["target_id"] for r in theirs.json()["results"]] == ["sb-2", "sb-1", "sb-0"]
    bad = http.get("/api/v1/activity", {"action": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "action"
    assert http.get("/api/v1/activity", {"cursor": "!!"}).status_code == 400
    assert http.get("/api/v1/activity", {"limit": "0"}).status_code == 400
    assert http.get("/api/v1/activity", {"since": "yesterday"}).status_code == 400


def test_the_log_needs_the_admin_scope(make_tenant, api_client):
    _, secret = make_tenant(scopes=["read", "write"])
    assert api_client(secret).get("/api/v1/activity").status_code == 403
    assert api_client(secret).get("/api/v1/activity/export").status_code == 403


def test_export_as_csv_and_jsonl_has_every_entry_and_no_secret(make_tenant, api_client):
    tenant, secret = make_tenant()
    http = api_client(secret)
    issued = http.post("/api/v1/keys", {"name": "exported"}, format="json").json()
    rotated = http.post(f"/api/v1/keys/{issued['id']}/rotate", {}, format="json").json()
    _fill(tenant, 3)
    as_csv = http.get("/api/v1/activity/export", {"output": "csv"})
    assert as_csv.status_code == 200 and as_csv["Content-Type"].startswith("text/csv")
    assert "attachment" in as_csv["Content-Disposition"]
    text = b"".join(as_csv.streaming_content).decode()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == Activity.objects.filter(tenant=tenant).count() == 6
    assert rows[-1]["action"] == "key.created"  # newest first; the fixture's key is oldest
    assert json.loads(rows[0]["details"]) == {}
    as_jsonl = http.get("/api/v1/activity/export", {"output": "jsonl", "action": "key.rotated"})
    lines = [json.loads(line) for line in b"".join(as_jsonl.streaming_content).splitlines()]
    assert [line["action"] for line in lines] == ["key.rotated"]
    assert lines[0]["details"]["old_prefix"] == issued["prefix"]
    for secret_text in (secret, issued["secret"], rotated["secret"]):
        assert secret_text not in text and secret_text not in json.dumps(lines)
    bad = http.get("/api/v1/activity/export", {"output": "xml"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "output"


def test_entries_past_the_retention_period_are_purged(make_tenant):
    tenant, _ = make_tenant()
    _fill(tenant, 2)
    old = Activity.objects.filter(tenant=tenant, target_id="sb-0")
    old.update(at=timezone.now() - timedelta(days=31))
    with override_settings(HEDGEROW_ACTIVITY_RETENTION_DAYS=30):
        assert activity_purge() == 1
    assert list(
        Activity.objects.filter(tenant=tenant, action="sandbox.deleted").values_list(
            "target_id", flat=True
        )
    ) == ["sb-1"]


def test_the_activity_page_shows_entries_to_admins_only(make_tenant, client):
    tenant, _ = make_tenant()
    owner = User.objects.create_user("ines", password="ines")
    membership_set_role(tenant=tenant, user=owner, role=Role.OWNER)
    viewer = User.objects.create_user("vic", password="vic")
    membership_set_role(tenant=tenant, user=viewer, role=Role.VIEWER)
    activity_record(
        tenant=tenant,
        actor="staff:root",
        action=Action.QUOTA_CHANGED,
        target_type="quota",
        target_id=str(tenant.pk),
        target_name="team limits",
        details={"max_cpu_millis": {"old": None, "new": 8000}},
    )
    client.force_login(owner)
    page = client.get("/activity/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "max_cpu_millis: none → 8000" in html and "staff:root" in html
    assert client.get("/activity/", {"action": "bogus"}).status_code == 400
    client.force_login(viewer)
    assert client.get("/activity/").status_code == 403


def test_the_activity_page_pages_older_entries_keeping_the_filter(make_tenant, client):
    tenant, _ = make_tenant()
    owner = User.objects.create_user("ida", password="ida")
    membership_set_role(tenant=tenant, user=owner, role=Role.OWNER)
    _fill(tenant, 55)
    client.force_login(owner)
    first = client.get("/activity/", {"action": "sandbox.deleted"})
    html = first.content.decode()
    assert html.count('data-action="sandbox.deleted"') == 50
    assert 'id="activity-older"' in html and "sb-54" in html and "sb-4<" not in html
    older_url = html.split('id="activity-older" href="')[1].split('"')[0].replace("&amp;", "&")
    assert "action=sandbox.deleted" in older_url and "cursor=" in older_url
    second = client.get("/activity/" + older_url).content.decode()
    assert second.count('data-action="sandbox.deleted"') == 5
    assert "sb-4<" in second and 'id="activity-older"' not in second
