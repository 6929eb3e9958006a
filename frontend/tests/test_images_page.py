"""The Images page (issue 24, for issue 15): the team's images with status, pull
progress, digest, size, layers, last use and live sandboxes; a pull form that proves
access against the real registry fixtures; delete that shows ``image_in_use`` plainly;
registry logins whose password is never rendered. Another team's rows do not exist."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from apps.images.models import Image, ImageStatus, RegistryCredential
from apps.images.tests.conftest import push_image
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER
from apps.sandboxes.models import State
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def unique_repo() -> Callable[[str], str]:
    """Repository names unique per test (the registries live for the whole session)."""
    return lambda name: f"t{uuid.uuid4().hex[:10]}/{name}"


def _client(make_user: Any, tenant: Any, role: str = "owner", name: str = "imguser") -> Client:
    make_user(name, (tenant, role))
    client = Client()
    assert client.login(username=name, password=name)
    return client


def test_it_lists_the_teams_images_with_status_progress_and_live_sandboxes(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    Image.objects.create(
        tenant=tenant,
        reference="ghcr.io/acme/ready:1",
        status=ImageStatus.READY,
        digest=DIGEST,
        size_bytes=3 * 1024 * 1024,
        layers=4,
    )
    Image.objects.create(
        tenant=tenant,
        reference="ghcr.io/acme/pulling:1",
        progress={"phase": "fetching", "layers": 2, "bytes": 512 * 1024, "total": 2048 * 1024},
    )
    Image.objects.create(
        tenant=tenant,
        reference="ghcr.io/acme/broken:1",
        status=ImageStatus.FAILED,
        error_code="registry_unauthorized",
        error_message="the registry refused the login",
    )
    Image.objects.create(tenant=other, reference="ghcr.io/rival/secret:1", digest=DIGEST)
    make_sandbox(tenant, image="ghcr.io/acme/ready:1", image_digest=DIGEST, state=State.READY)
    make_sandbox(tenant, image="ghcr.io/acme/ready:1", image_digest=DIGEST, state=State.DELETED)
    make_sandbox(other, image="ghcr.io/rival/secret:1", image_digest=DIGEST, state=State.READY)

    page = _client(make_user, tenant).get("/images/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<a href="/images/" aria-current="page">Images</a>' in html
    assert "ghcr.io/rival/secret:1" not in html
    ready = Image.objects.get(reference="ghcr.io/acme/ready:1")
    row = html.split(f'data-image-id="{ready.pk}"')[1].split("</tr>")[0]
    assert "ready" in row and "3.0 MiB" in row and ">4<" in row
    assert "sha256:abababab" in row
    # one live sandbox: the deleted one and the other team's do not count
    assert '<td class="num" data-image-sandboxes>1</td>' in row
    pulling = html.split('data-status="pulling"')[1].split("</tr>")[0]
    assert "fetching · 512.0 KiB of 2.0 MiB · 2 layers" in pulling
    assert 'style="width:25%"' in pulling
    failed = html.split('data-status="failed"')[1].split("</tr>")[0]
    assert "registry_unauthorized" in failed and "the registry refused the login" in failed
    assert 'data-pulling="yes"' in html


def test_it_pulls_from_the_page_and_redirects_so_a_reload_does_not_pull_again(
    make_tenant, make_user, open_registry, tmp_path: Path, unique_repo
):
    tenant, _ = make_tenant()
    ref, digest = push_image(open_registry, tmp_path, unique_repo("page"))
    client = _client(make_user, tenant)
    answer = client.post("/images/", {"reference": ref})
    assert answer.status_code == 302 and answer["Location"] == "/images/"
    image = Image.objects.get(tenant=tenant)
    assert (image.reference, image.status, image.digest) == (ref, ImageStatus.PULLING, digest)
    shown = client.get("/images/").content.decode()
    assert f"Pulling {ref}." in shown
    assert f'data-image-id="{image.pk}" data-status="pulling"' in shown


def test_a_refused_pull_shows_the_typed_error_by_the_field_and_records_nothing(
    make_tenant, make_user, registry, tmp_path: Path, unique_repo
):
    tenant, _ = make_tenant()
    ref, _ = push_image(registry, tmp_path, unique_repo("private"))
    client = _client(make_user, tenant)
    answer = client.post("/images/", {"reference": ref})
    html = answer.content.decode()
    assert answer.status_code == 200
    assert 'id="e-reference"' in html and "registry_unauthorized" in html
    assert f'value="{ref}"' in html
    bad = client.post("/images/", {"reference": "Not A Reference!"}).content.decode()
    assert "image_reference_invalid" in bad
    assert not Image.objects.filter(tenant=tenant).exists()


def test_a_login_is_stored_encrypted_never_shown_and_then_used_for_the_pull(
    make_tenant, make_user, registry, tmp_path: Path, unique_repo
):
    tenant, _ = make_tenant()
    ref, digest = push_image(registry, tmp_path, unique_repo("login"))
    client = _client(make_user, tenant)
    # an invalid host is refused by its field; the password is not echoed into the form
    refused = client.post(
        "/images/credentials", {"registry": "not a host", "username": USER, "password": PASSWORD}
    ).content.decode()
    assert 'id="e-registry"' in refused and PASSWORD not in refused
    assert not RegistryCredential.objects.filter(tenant=tenant).exists()

    stored = client.post(
        "/images/credentials", {"registry": registry.host, "username": USER, "password": PASSWORD}
    )
    assert stored.status_code == 302
    cred = RegistryCredential.objects.get(tenant=tenant)
    assert cred.registry == registry.host and PASSWORD not in cred.password_encrypted
    html = client.get("/images/").content.decode()
    assert f'data-registry="{registry.host}"' in html and USER in html
    assert PASSWORD not in html

    assert client.post("/images/", {"reference": ref}).status_code == 302
    image = Image.objects.get(tenant=tenant)
    assert (image.digest, image.private) == (digest, True)

    assert client.post(f"/images/credentials/{cred.pk}/delete").status_code == 302
    assert not RegistryCredential.objects.filter(tenant=tenant).exists()


def test_deleting_an_image_in_use_says_so_and_keeps_it(make_tenant, make_user):
    tenant, _ = make_tenant()
    used = Image.objects.create(
        tenant=tenant, reference="ghcr.io/acme/used:1", status=ImageStatus.READY, digest=DIGEST
    )
    idle = Image.objects.create(
        tenant=tenant, reference="ghcr.io/acme/idle:1", status=ImageStatus.READY
    )
    make_sandbox(tenant, image=used.reference, image_digest=DIGEST, state=State.READY)
    client = _client(make_user, tenant)
    refused = client.post(f"/images/{used.pk}/delete", follow=True).content.decode()
    assert "ghcr.io/acme/used:1 was not deleted: 1 live sandbox uses it." in refused
    assert 'class="flash flash-error" role="alert"' in refused
    assert Image.objects.filter(pk=used.pk).exists()
    deleted = client.post(f"/images/{idle.pk}/delete", follow=True).content.decode()
    assert "Deleted ghcr.io/acme/idle:1." in deleted
    assert not Image.objects.filter(pk=idle.pk).exists()


def test_another_teams_image_and_login_are_not_found_and_viewers_cannot_write(
    make_tenant, make_user
):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    theirs = Image.objects.create(tenant=other, reference="ghcr.io/rival/x:1")
    their_login = RegistryCredential.objects.create(
        tenant=other, registry="ghcr.io", username="rival", password_encrypted="x"
    )
    owner = _client(make_user, tenant)
    assert owner.post(f"/images/{theirs.pk}/delete").status_code == 404
    assert owner.post(f"/images/credentials/{their_login.pk}/delete").status_code == 404
    assert Image.objects.filter(pk=theirs.pk).exists()
    assert RegistryCredential.objects.filter(pk=their_login.pk).exists()

    mine = Image.objects.create(tenant=tenant, reference="ghcr.io/acme/mine:1")
    viewer = _client(make_user, tenant, role="viewer", name="imgviewer")
    html = viewer.get("/images/").content.decode()
    assert "ghcr.io/acme/mine:1" in html and "Pull an image" not in html
    assert viewer.post("/images/", {"reference": "python:3.12"}).status_code == 403
    assert viewer.post(f"/images/{mine.pk}/delete").status_code == 403
    assert (
        viewer.post(
            "/images/credentials", {"registry": "ghcr.io", "username": "u", "password": "p"}
        ).status_code
        == 403
    )
    assert Image.objects.filter(pk=mine.pk).exists()
    assert not RegistryCredential.objects.filter(tenant=tenant).exists()


def test_a_provisioning_sandbox_shows_its_image_pull_progress(make_tenant, make_user):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(
        tenant,
        image="ghcr.io/acme/big:1",
        state=State.PROVISIONING,
        progress={"phase": "fetching", "layers": 3, "bytes": 1024 * 1024, "total": 4 * 1024 * 1024},
    )
    client = _client(make_user, tenant)
    html = client.get(f"/sandboxes/{sandbox.external_id}/").content.decode()
    assert "data-provision-progress" in html
    assert "fetching · 1.0 MiB of 4.0 MiB · 3 layers" in html
    header = client.get(f"/sandboxes/{sandbox.external_id}/header").content.decode()
    assert "fetching · 1.0 MiB of 4.0 MiB" in header
    sandbox.state = State.READY
    sandbox.progress = None
    sandbox.save()
    assert (
        "data-provision-progress"
        not in client.get(f"/sandboxes/{sandbox.external_id}/header").content.decode()
    )
