"""Dead ends get a styled page with a way back: unknown paths, another team's objects."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

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
