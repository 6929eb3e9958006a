"""Dead ends get a styled page with a way back: unknown paths, another team's objects,
no team (staff get the pages they can open), an expired form."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.sandboxes.tests.factories import make_sandbox
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db


def test_an_unknown_page_is_a_styled_404_with_a_way_back(client) -> None:
    response = client.get("/no/such/page/")
    assert response.status_code == 404
    html = response.content.decode()
    assert 'id="not-found"' in html and 'href="/"' in html
    assert "/no/such/page/" in html
    assert 'lang="en"' in html


def test_another_teams_sandbox_is_the_same_styled_404(make_tenant, client) -> None:
    mine, _ = make_tenant()
    theirs, _ = make_tenant()
    other = make_sandbox(theirs)
    user = User.objects.create_user("ana", password="pw")
    membership_set_role(tenant=mine, user=user, role="owner")
    client.force_login(user)
    response = client.get(f"/sandboxes/{other.external_id}/")
    assert response.status_code == 404
    assert 'id="not-found"' in response.content.decode()


def test_a_staff_user_without_a_team_is_told_what_staff_can_open(client) -> None:
    staff = User.objects.create_user("ops", password="pw", is_staff=True)
    client.force_login(staff)
    response = client.get("/sandboxes/")
    assert response.status_code == 403
    html = response.content.decode()
    assert 'id="no-team"' in html and 'name="viewport"' in html
    for href in ('href="/billing/staff/costs/"', 'href="/reports/leaks"', 'href="/admin/'):
        assert href in html
    assert client.get("/billing/staff/costs/").status_code == 200  # the links lead somewhere


def test_a_member_without_a_team_is_not_offered_staff_pages(client) -> None:
    user = User.objects.create_user("newbie", password="pw")
    client.force_login(user)
    html = client.get("/sandboxes/").content.decode()
    assert "Ask an owner or admin of your team to add <strong>newbie</strong>" in html
    assert 'id="staff-links"' not in html


def test_an_expired_form_is_a_styled_403_with_a_way_back(make_tenant) -> None:
    """A POST whose CSRF token no longer matches (a tab left open across a sign-in)
    answered with Django's bare 'CSRF verification failed' page."""
    tenant, _ = make_tenant()
    user = User.objects.create_user("kim", password="pw")
    membership_set_role(tenant=tenant, user=user, role="owner")
    keys_before = tenant.api_keys.count()
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    response = strict.post("/keys/", {"name": "ci", "scopes": ["read"]})
    assert response.status_code == 403
    html = response.content.decode()
    assert 'id="forbidden"' in html and "This form expired" in html
    assert 'href="/"' in html and 'lang="en"' in html
    assert tenant.api_keys.count() == keys_before  # nothing created
