"""Issue 24, defect 9: members can be removed. Owners and admins only; only an owner
removes an owner; the last owner stays; another team's member is not found; a removed
user no longer acts for the team."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.tenancy.models import Membership

pytestmark = pytest.mark.django_db


def _client(name: str) -> Client:
    client = Client()
    assert client.login(username=name, password=name)
    return client


def test_members_are_removed_by_owners_and_admins_within_the_rules(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    make_user("rowner", (tenant, "owner"))
    make_user("radmin", (tenant, "admin"))
    make_user("rmember", (tenant, "member"), (other, "member"))
    make_user("rviewer", (tenant, "viewer"))
    make_user("stranger", (other, "owner"))
    ms = {m.user.username: m for m in Membership.objects.filter(tenant=tenant)}
    theirs = Membership.objects.get(tenant=other, user__username="stranger")

    page = _client("radmin").get("/members/").content.decode()
    assert 'aria-label="Remove rmember"' in page and 'aria-label="Remove rowner"' not in page

    viewer = _client("rviewer")
    assert (
        viewer.post(
            "/members/", {"action": "remove", "membership_id": ms["rmember"].pk}
        ).status_code
        == 403
    )
    admin = _client("radmin")
    assert (
        admin.post("/members/", {"action": "remove", "membership_id": ms["rowner"].pk}).status_code
        == 403
    )
    assert (
        admin.post("/members/", {"action": "remove", "membership_id": theirs.pk}).status_code == 404
    )

    member = _client("rmember")
    assert member.get("/sandboxes/").status_code == 200
    done = admin.post("/members/", {"action": "remove", "membership_id": ms["rmember"].pk})
    assert done.status_code == 302
    assert "Removed rmember from the team." in admin.get("/members/").content.decode()
    assert not Membership.objects.filter(pk=ms["rmember"].pk).exists()
    assert Membership.objects.filter(tenant=other, user__username="rmember").exists()
    # their session now acts for the team they still belong to, never this one
    assert member.get("/sandboxes/").wsgi_request.session["tenant_id"] == str(other.pk)

    owner = _client("rowner")
    last = owner.post("/members/", {"action": "remove", "membership_id": ms["rowner"].pk})
    assert "a team needs at least one owner" in last.content.decode()
    assert Membership.objects.filter(pk=ms["rowner"].pk).exists()
    assert (
        owner.post("/members/", {"action": "remove", "membership_id": ms["radmin"].pk}).status_code
        == 302
    )
    assert set(
        Membership.objects.filter(tenant=tenant).values_list("user__username", flat=True)
    ) == {
        "rowner",
        "rviewer",
    }
