"""Images and registry credentials over REST, against the real registry fixtures:
typed errors with the contract's HTTP statuses, tenant isolation, single-flight pulls,
secrets never shown, and sandbox creates that name an image exactly."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
from django.test import Client

from apps.images import crypto
from apps.images.models import Image, ImageStatus, RegistryCredential
from apps.images.tests.conftest import layout_tarball, push_image
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER
from apps.sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db


def _error(response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    body: dict[str, Any] = response.json()["error"]
    assert body["code"] == code, body
    return body


def _store_login(client, registry, password: str = PASSWORD):
    return client.post(
        "/api/v1/registry-credentials",
        {"registry": registry.host, "username": USER, "password": password},
        format="json",
    )


# --- registry credentials ------------------------------------------------------------


def test_a_credential_is_stored_encrypted_and_its_password_never_shown(
    make_tenant, api_client, registry, caplog
):
    caplog.set_level(logging.DEBUG)
    tenant, secret = make_tenant()
    client = api_client(secret)
    created = _store_login(client, registry)
    assert created.status_code == 201, created.content
    body = created.json()
    assert set(body) == {"id", "registry", "username", "created_at"}
    assert (body["registry"], body["username"]) == (registry.host, USER)
    listed = client.get("/api/v1/registry-credentials")
    got = client.get(f"/api/v1/registry-credentials/{body['id']}")
    for response in (created, listed, got):
        assert PASSWORD not in response.content.decode()
    assert [c["id"] for c in listed.json()["results"]] == [body["id"]]
    row = RegistryCredential.objects.get(pk=body["id"])
    assert PASSWORD not in row.password_encrypted
    assert crypto.decrypt(row.password_encrypted) == PASSWORD
    assert PASSWORD not in caplog.text
    # one per registry: a second POST replaces the login
    again = _store_login(client, registry, password="rotated")
    assert again.status_code == 201
    assert RegistryCredential.objects.filter(tenant=tenant).count() == 1
    assert crypto.decrypt(RegistryCredential.objects.get(tenant=tenant).password_encrypted) == (
        "rotated"
    )
    assert client.delete(f"/api/v1/registry-credentials/{again.json()['id']}").status_code == 204
    assert not RegistryCredential.objects.filter(tenant=tenant).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"registry": "not a host!", "username": "u", "password": "p"}, "registry"),
        ({"registry": "ghcr.io", "username": "u"}, "password"),
        ({"registry": "ghcr.io", "password": "p"}, "username"),
    ],
)
def test_a_bad_credential_is_a_typed_400_and_nothing_stored(make_tenant, api_client, body, field):
    _, secret = make_tenant()
    response = api_client(secret).post("/api/v1/registry-credentials", body, format="json")
    error = _error(response, 400, "validation_error")
    assert error["field"] == field
    assert not RegistryCredential.objects.exists()


def test_another_tenants_credential_is_a_404(make_tenant, api_client, registry):
    _, owner_secret = make_tenant()
    _, outsider_secret = make_tenant()
    cred_id = _store_login(api_client(owner_secret), registry).json()["id"]
    outsider = api_client(outsider_secret)
    for method in ("get", "delete"):
        response = getattr(outsider, method)(f"/api/v1/registry-credentials/{cred_id}")
        _error(response, 404, "registry_credential_not_found")
    assert outsider.get("/api/v1/registry-credentials").json()["results"] == []
    assert RegistryCredential.objects.filter(pk=cred_id).exists()


# --- images: typed errors ---------------------------------------------------------


def test_pull_errors_are_typed_and_record_nothing(
    make_tenant, api_client, registry, open_registry, tmp_path, unique_repo
):
    _, secret = make_tenant()
    client = api_client(secret)
    private_ref, _ = push_image(registry, tmp_path, unique_repo("private"))
    cases = [
        ("Not A Reference!", 400, "image_reference_invalid"),
        (f"{open_registry.host}/{unique_repo('missing')}:v1", 422, "image_not_found"),
        (private_ref, 422, "registry_unauthorized"),  # no stored login
    ]
    for reference, status, code in cases:
        error = _error(
            client.post("/api/v1/images", {"reference": reference}, format="json"), status, code
        )
        assert error["field"] in ("image", "reference")
        assert error["reference"] == reference
    assert _store_login(client, registry, password="wrong").status_code == 201
    error = _error(
        client.post("/api/v1/images", {"reference": private_ref}, format="json"),
        422,
        "registry_unauthorized",
    )
    assert "wrong" not in json.dumps(error)
    assert not Image.objects.exists()


def test_a_pull_request_is_recorded_once_while_in_flight(
    make_tenant, api_client, open_registry, tmp_path, unique_repo
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    ref, digest = push_image(open_registry, tmp_path, unique_repo("public"))
    first = client.post("/api/v1/images", {"reference": ref}, format="json")
    assert first.status_code == 202, first.content
    body = first.json()
    assert body["status"] == "pulling" and body["digest"] == digest
    assert body["progress"]["phase"] == "queued" and body["error"] is None
    assert body["private"] is False and body["sandboxes"] == 0
    # the same image by another spelling is the same record
    second = client.post("/api/v1/images", {"reference": ref.replace(":v1", ":v1")}, format="json")
    assert second.status_code == 202 and second.json()["id"] == body["id"]
    assert Image.objects.filter(tenant=tenant).count() == 1
    listed = client.get("/api/v1/images").json()
    assert listed["count"] == 1 and listed["results"][0]["id"] == body["id"]
    assert client.get(f"/api/v1/images/{body['id']}").json()["reference"] == ref


def test_a_private_image_needs_each_tenants_own_login(
    make_tenant, api_client, registry, tmp_path, unique_repo
):
    _, a_secret = make_tenant()
    _, b_secret = make_tenant()
    a, b = api_client(a_secret), api_client(b_secret)
    ref, digest = push_image(registry, tmp_path, unique_repo("secret"))
    assert _store_login(a, registry).status_code == 201
    pulled = a.post("/api/v1/images", {"reference": ref}, format="json")
    assert pulled.status_code == 202 and pulled.json()["private"] is True
    # tenant B knows the reference (and digest) but has no login: refused, by tag or digest
    for reference in (ref, f"{ref.rsplit(':', 1)[0]}@{digest}"):
        _error(
            b.post("/api/v1/images", {"reference": reference}, format="json"),
            422,
            "registry_unauthorized",
        )
        _error(
            b.post("/api/v1/sandboxes", {"image": reference}, format="json"),
            422,
            "registry_unauthorized",
        )
    _error(b.get(f"/api/v1/images/{pulled.json()['id']}"), 404, "image_not_found_here")
    _error(b.delete(f"/api/v1/images/{pulled.json()['id']}"), 404, "image_not_found_here")
    assert b.get("/api/v1/images").json()["count"] == 0
    assert not Sandbox.objects.exists()


def test_import_of_an_oci_layout_tarball(make_tenant, api_client, tmp_path, unique_repo):
    tenant, secret = make_tenant()
    client = api_client(secret)
    data, digest = layout_tarball(tmp_path)
    ref = f"imported.example/{unique_repo('tool')}:1"
    upload = io.BytesIO(data)
    upload.name = "image.tar"
    response = client.post(
        "/api/v1/images/import", {"file": upload, "reference": ref}, format="multipart"
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["status"], body["digest"], body["layers"]) == ("ready", digest, 1)
    assert body["size_bytes"] > 0 and body["reference"] == ref
    image = Image.objects.get(tenant=tenant)
    assert image.imported and image.status == ImageStatus.READY
    # a sandbox may name it: resolved from the tenant's own import, digest recorded
    created = client.post("/api/v1/sandboxes", {"image": ref}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["image_digest"] == digest
    used = client.get(f"/api/v1/images/{body['id']}").json()
    assert used["last_used_at"] is not None and used["sandboxes"] == 1


def test_import_of_garbage_is_a_typed_422_and_records_nothing(make_tenant, api_client):
    _, secret = make_tenant()
    upload = io.BytesIO(b"this is not a tarball" * 100)
    upload.name = "junk.tar"
    response = api_client(secret).post(
        "/api/v1/images/import",
        {"file": upload, "reference": "imported.example/junk:1"},
        format="multipart",
    )
    _error(response, 422, "image_archive_invalid")
    assert not Image.objects.exists()


def test_delete_forgets_the_image(make_tenant, api_client, tmp_path, unique_repo):
    tenant, secret = make_tenant()
    client = api_client(secret)
    data, _ = layout_tarball(tmp_path)
    upload = io.BytesIO(data)
    upload.name = "image.tar"
    ref = f"imported.example/{unique_repo('gone')}:1"
    image_id = client.post(
        "/api/v1/images/import", {"file": upload, "reference": ref}, format="multipart"
    ).json()["id"]
    # a live sandbox of the tenant runs it: 409 image_in_use, nothing removed
    created = client.post("/api/v1/sandboxes", {"image": ref}, format="json")
    assert created.status_code == 201, created.content
    _error(client.delete(f"/api/v1/images/{image_id}"), 409, "image_in_use")
    assert client.get(f"/api/v1/images/{image_id}").json()["sandboxes"] == 1
    Sandbox.objects.filter(tenant=tenant).update(state="deleted")
    assert client.delete(f"/api/v1/images/{image_id}").status_code == 204
    _error(client.get(f"/api/v1/images/{image_id}"), 404, "image_not_found_here")


# --- sandbox creates name an image exactly -------------------------------------------


def test_a_create_with_an_image_that_cannot_be_had_is_a_typed_4xx_and_no_row(
    make_tenant, api_client, open_registry, unique_repo
):
    _, secret = make_tenant()
    missing = f"{open_registry.host}/{unique_repo('nothing')}:v1"
    error = _error(
        api_client(secret).post("/api/v1/sandboxes", {"image": missing}, format="json"),
        422,
        "image_not_found",
    )
    assert (error["field"], error["reference"]) == ("image", missing)
    _error(
        api_client(secret).post("/api/v1/sandboxes", {"image": "Bad Ref!"}, format="json"),
        400,
        "image_reference_invalid",
    )
    assert not Sandbox.objects.exists() and not SandboxEvent.objects.exists()


def test_orchard_create_never_falls_back_to_host(make_tenant, open_registry, unique_repo):
    _, secret = make_tenant()
    missing = f"{open_registry.host}/{unique_repo('nothing')}:v1"
    response = Client().post(
        "/orchard/sandboxes",
        data=json.dumps({"image": missing}),
        content_type="application/json",
        headers={"X-API-Key": secret},
    )
    assert response.status_code == 422, response.content
    assert response.json()["code"] == "image_not_found"
    assert not Sandbox.objects.exists()


def test_a_create_with_a_private_image_uses_the_stored_login(
    make_tenant, api_client, registry, tmp_path, unique_repo
):
    _, secret = make_tenant()
    client = api_client(secret)
    ref, digest = push_image(registry, tmp_path, unique_repo("app"))
    _error(
        client.post("/api/v1/sandboxes", {"image": ref}, format="json"),
        422,
        "registry_unauthorized",
    )
    assert _store_login(client, registry).status_code == 201
    created = client.post("/api/v1/sandboxes", {"image": ref}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["image"], body["image_digest"], body["progress"]) == (ref, digest, None)
    host = client.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert host.status_code == 201 and host.json()["image_digest"] == ""


def test_one_pull_task_per_flight_and_a_dead_flight_is_restarted(
    make_tenant, api_client, open_registry, tmp_path, unique_repo,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    from datetime import timedelta

    from django.utils import timezone

    from apps.images.services import PULL_STALE_S

    _, secret = make_tenant()
    client = api_client(secret)
    ref, _ = push_image(open_registry, tmp_path, unique_repo("flight"))
    with django_capture_on_commit_callbacks(execute=False) as first:
        image_id = client.post("/api/v1/images", {"reference": ref}, format="json").json()["id"]
    with django_capture_on_commit_callbacks(execute=False) as second:
        again = client.post("/api/v1/images", {"reference": ref}, format="json")
    assert again.json()["id"] == image_id
    assert (len(first), len(second)) == (1, 0)  # one pull task enqueued, not two
    # its worker died: no progress for longer than PULL_STALE_S → the next POST restarts it
    old = timezone.now() - timedelta(seconds=PULL_STALE_S + 1)
    Image.objects.filter(pk=image_id).update(updated_at=old)
    with django_capture_on_commit_callbacks(execute=False) as third:
        restarted = client.post("/api/v1/images", {"reference": ref}, format="json")
    assert restarted.status_code == 202 and restarted.json()["id"] == image_id
    assert len(third) == 1
    assert Image.objects.get(pk=image_id).updated_at > old
