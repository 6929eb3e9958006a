"""The dashboard's create form offers the team's own ready images (and the built-in
names), never another team's from the machine-wide store."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.images.models import Image, ImageStatus
from apps.sandboxes.models import Sandbox

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


def test_the_create_form_answers_an_image_it_cannot_have_with_a_typed_error(
    make_tenant, make_user, open_registry
):
    """An image the backend cannot get (here: not in the registry; equally a revoked
    login) is a 400 naming the image and the reason on the form's image field, and no
    sandbox — never a sandbox of `host` instead."""
    tenant, _ = make_tenant()
    make_user("imgform", (tenant, "owner"))
    client = Client()
    assert client.login(username="imgform", password="imgform")
    missing = f"{open_registry.host}/dash/nothing:v1"
    response = client.post("/sandboxes/new", {"image": missing, "cpu": "1", "memory": "1Gi"})
    assert response.status_code == 400
    page = response.content.decode()
    error = page.split('id="e-image">', 1)[1].split("</div>", 1)[0]
    assert missing in error and "image_not_found" in error, error
    # htmx: the form is swapped in place with the same error
    swapped = client.post(
        "/sandboxes/new", {"image": missing, "cpu": "1", "memory": "1Gi"}, HTTP_HX_REQUEST="true"
    )
    assert swapped.status_code == 200 and swapped["HX-Reswap"] == "outerHTML"
    assert "image_not_found" in swapped.content.decode()
    assert not Sandbox.objects.filter(tenant=tenant).exists()
