"""Security review of the dashboard's writes and staff pages: another team's objects are
404s and stay unchanged, viewers change nothing, staff pages refuse everyone else, and
no form sends the browser to another site."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from apps.sandboxes.models import AuditRun, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox
from apps.tenancy.models import ApiKey, Membership

pytestmark = pytest.mark.django_db


def _signed_in(make_user: Any, username: str, *memberships: Any) -> Client:
    make_user(username, *memberships)
    client = Client()
    assert client.login(username=username, password=username)
    return client


def test_it_answers_404_to_another_teams_admin_and_changes_nothing(make_tenant, make_user):
    owner_team, _ = make_tenant()
    other_team, _ = make_tenant()
    sandbox = make_sandbox(owner_team, external_id="sb-owned")
    key = ApiKey.objects.get(tenant=owner_team)
    _signed_in(make_user, "victim", (owner_team, "member"))
    membership = Membership.objects.get(user__username="victim")
    other = _signed_in(make_user, "other-owner", (other_team, "owner"))

    assert other.post("/sandboxes/sb-owned/delete").status_code == 404
    assert other.post(f"/keys/{key.pk}/revoke").status_code == 404
    promote = {"action": "role", "membership_id": membership.pk, "role": "owner"}
    assert other.post("/members/", promote).status_code == 404
    assert str(key.pk) not in other.get("/keys/").content.decode()
    assert b"victim" not in other.get("/members/").content

    sandbox.refresh_from_db()
    key.refresh_from_db()
    membership.refresh_from_db()
    assert (sandbox.state, key.revoked_at, membership.role) == (State.READY, None, "member")
    assert not SandboxEvent.objects.filter(sandbox=sandbox).exists()


def test_it_lets_a_viewer_change_nothing(make_tenant, make_user):
    team, _ = make_tenant()
    sandbox = make_sandbox(team, external_id="sb-viewed")
    key = ApiKey.objects.get(tenant=team)
    viewer = _signed_in(make_user, "viewer", (team, "viewer"))
    _signed_in(make_user, "peer", (team, "member"))
    peer = Membership.objects.get(user__username="peer")

    assert viewer.post("/sandboxes/sb-viewed/delete").status_code == 403
    assert viewer.post(f"/keys/{key.pk}/revoke").status_code == 403
    assert viewer.post("/keys/", {"name": "mine", "scopes": ["read"]}).status_code == 403
    promote = {"action": "role", "membership_id": peer.pk, "role": "admin"}
    assert viewer.post("/members/", promote).status_code == 403

    sandbox.refresh_from_db()
    key.refresh_from_db()
    peer.refresh_from_db()
    assert (sandbox.state, key.revoked_at, peer.role) == (State.READY, None, "member")
    assert ApiKey.objects.filter(tenant=team).count() == 1


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/reports/leaks"),
        ("post", "/reports/leaks/run"),
        ("get", "/billing/staff/costs/"),
        ("get", "/admin/"),
        ("get", "/admin/billing/apikey/"),
    ],
)
def test_it_keeps_staff_pages_from_team_owners(make_tenant, make_user, method, path):
    team, _ = make_tenant()
    owner = _signed_in(make_user, "owner", (team, "owner"))
    response = getattr(owner, method)(path, {"reclaim": "1", "reconcile": "1"})
    if path.startswith("/admin/"):  # Django's admin keeps its own sign-in redirect
        assert response.status_code == 302, response.status_code
        assert response["Location"].startswith("/admin/login/")
    else:
        assert response.status_code == 403, response.status_code
        assert 'id="staff-only"' in response.content.decode()
    assert not AuditRun.objects.exists()


def test_it_keeps_redirects_after_a_form_on_this_site(make_tenant, make_user):
    team, _ = make_tenant()
    make_sandbox(team, external_id="sb-next")
    member = _signed_in(make_user, "member", (team, "member"))
    for target in ("https://evil.example/phish", "//evil.example/x", "/\\evil.example"):
        deleted = member.post("/sandboxes/sb-next/delete", {"next": target})
        assert deleted.status_code == 302
        assert "evil.example" not in deleted["Location"], target
        switched = member.post("/team/switch", {"tenant_id": str(team.pk), "next": target})
        assert "evil.example" not in switched["Location"], target
    kept = member.post("/sandboxes/sb-next/delete", {"next": "/sandboxes/?state=ready"})
    assert kept["Location"] == "/sandboxes/?state=ready"
