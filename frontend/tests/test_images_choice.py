"""The dashboard's create form offers the team's own ready images (and the built-in
names), never another team's from the machine-wide store."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.images.models import Image, ImageStatus

pytestmark = pytest.mark.django_db


def test_the_create_form_offers_only_the_teams_ready_images(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    Image.objects.create(tenant=tenant, reference="ghcr.io/acme/mine:1", status=ImageStatus.READY)
    Image.objects.create(tenant=tenant, reference="ghcr.io/acme/pulling:1")
    Image.objects.create(tenant=other, reference="ghcr.io/rival/theirs:1", status=ImageStatus.READY)
    make_user("imgowner", (tenant, "owner"))
    client = Client()
    assert client.login(username="imgowner", password="imgowner")
    page = client.get("/sandboxes/").content.decode()
    assert '<option value="host"' in page
    assert '<option value="ghcr.io/acme/mine:1"' in page
    assert "ghcr.io/acme/pulling:1" not in page
    assert "ghcr.io/rival/theirs:1" not in page
