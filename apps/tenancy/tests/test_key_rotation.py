"""Keys: rename, rotate with a grace period for the old secret, last-used time and
source address (issue 24, "Keys")."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from apps.tenancy.auth import forget_cached_keys
from apps.tenancy.models import ApiKey
from apps.tenancy.secrets import hash_secret

pytestmark = pytest.mark.django_db


def test_a_rename_keeps_the_secret_and_is_validated(make_tenant, api_client):
    tenant, secret = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    http = api_client(secret)
    renamed = http.patch(f"/api/v1/keys/{key.pk}", {"name": "  ci-nightly "}, format="json")
    assert renamed.status_code == 200, renamed.content
    assert renamed.json()["name"] == "ci-nightly" and "secret" not in renamed.json()
    key.refresh_from_db()
    assert (key.name, key.secret_hash) == ("ci-nightly", hash_secret(secret))
    assert http.get("/api/v1/sandboxes").status_code == 200  # the same secret still works
    blank = http.patch(f"/api/v1/keys/{key.pk}", {"name": "   "}, format="json")
    assert blank.status_code == 400 and blank.json()["error"]["field"] == "name"
    key.refresh_from_db()
    assert key.name == "ci-nightly"


def test_rotation_shows_a_new_secret_once_and_keeps_the_old_one_for_the_grace(
    make_tenant, api_client
):
    tenant, old = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    rotated = api_client(old).post(
        f"/api/v1/keys/{key.pk}/rotate", {"grace_seconds": 3600}, format="json"
    )
    assert rotated.status_code == 200, rotated.content
    body = rotated.json()
    new = body["secret"]
    assert new.startswith("hr_") and new != old and new.startswith(body["prefix"])
    assert body["id"] == str(key.pk) and body["rotated_at"] is not None
    key.refresh_from_db()
    assert key.secret_hash == hash_secret(new) and key.previous_secret_hash == hash_secret(old)
    assert new not in str(ApiKey.objects.filter(pk=key.pk).values().first())
    assert key.previous_valid_until is not None
    grace_left = key.previous_valid_until - timezone.now()
    assert timedelta(minutes=59) < grace_left <= timedelta(hours=1)
    # both work during the grace
    assert api_client(new).get("/api/v1/sandboxes").status_code == 200
    assert api_client(old).get("/api/v1/sandboxes").status_code == 200
    # the key list never shows either secret
    listed = api_client(new).get("/api/v1/keys").content.decode()
    assert new not in listed and old not in listed
    # once the grace is over the old secret is refused (also from this process's cache)
    ApiKey.objects.filter(pk=key.pk).update(
        previous_valid_until=timezone.now() - timedelta(seconds=1)
    )
    forget_cached_keys()
    refused = api_client(old).get("/api/v1/sandboxes")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert api_client(new).get("/api/v1/sandboxes").status_code == 200


def test_a_cached_old_secret_is_refused_when_its_grace_ends(make_tenant, api_client):
    """The in-process key cache must not stretch a grace period."""
    tenant, old = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    rotated = api_client(old).post(
        f"/api/v1/keys/{key.pk}/rotate", {"grace_seconds": 60}, format="json"
    )
    assert rotated.status_code == 200
    assert api_client(old).get("/api/v1/sandboxes").status_code == 200  # now cached
    cached = ApiKey.objects.get(pk=key.pk)
    from apps.tenancy import auth

    principal, at = auth._key_cache[hash_secret(old)]
    assert principal.api_key is not None
    principal.api_key.previous_valid_until = timezone.now() - timedelta(seconds=1)
    ApiKey.objects.filter(pk=cached.pk).update(
        previous_valid_until=principal.api_key.previous_valid_until
    )
    assert api_client(old).get("/api/v1/sandboxes").status_code == 401


def test_rotation_without_grace_refuses_the_old_secret_at_once(make_tenant, api_client):
    tenant, old = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    rotated = api_client(old).post(
        f"/api/v1/keys/{key.pk}/rotate", {"grace_seconds": 0}, format="json"
    )
    assert rotated.status_code == 200
    assert rotated.json()["previous_valid_until"] is None
    assert api_client(old).get("/api/v1/sandboxes").status_code == 401
    assert api_client(rotated.json()["secret"]).get("/api/v1/sandboxes").status_code == 200


@override_settings(HEDGEROW_KEY_ROTATION_GRACE_S=120, HEDGEROW_KEY_ROTATION_MAX_GRACE_S=600)
def test_the_grace_defaults_to_the_setting_and_is_bounded(make_tenant, api_client):
    tenant, secret = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    http = api_client(secret)
    too_long = http.post(f"/api/v1/keys/{key.pk}/rotate", {"grace_seconds": 601}, format="json")
    assert too_long.status_code == 400
    assert too_long.json()["error"]["field"] == "grace_seconds"
    negative = http.post(f"/api/v1/keys/{key.pk}/rotate", {"grace_seconds": -1}, format="json")
    assert negative.status_code == 400
    key.refresh_from_db()
    assert key.secret_hash == hash_secret(secret) and key.rotated_at is None  # untouched
    default = http.post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json")
    assert default.status_code == 200
    key.refresh_from_db()
    assert key.previous_valid_until is not None
    left = key.previous_valid_until - timezone.now()
    assert timedelta(seconds=110) < left <= timedelta(seconds=120)


def test_rotating_again_ends_the_older_secrets_grace(make_tenant, api_client):
    tenant, first = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    second = api_client(first).post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json").json()
    third = api_client(second["secret"]).post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json")
    assert third.status_code == 200
    forget_cached_keys()
    assert api_client(first).get("/api/v1/sandboxes").status_code == 401
    assert api_client(second["secret"]).get("/api/v1/sandboxes").status_code == 200
    assert api_client(third.json()["secret"]).get("/api/v1/sandboxes").status_code == 200


def test_a_revoked_key_cannot_be_rotated_and_revoking_ends_the_grace(make_tenant, api_client):
    tenant, admin = make_tenant()
    from apps.tenancy.services import api_key_create

    other = api_key_create(tenant=tenant, name="worker", scopes=["read"])
    rotated = api_client(admin).post(f"/api/v1/keys/{other.key.pk}/rotate", {}, format="json")
    assert rotated.status_code == 200
    assert api_client(admin).delete(f"/api/v1/keys/{other.key.pk}").status_code == 200
    assert api_client(other.secret).get("/api/v1/sandboxes").status_code == 401
    assert api_client(rotated.json()["secret"]).get("/api/v1/sandboxes").status_code == 401
    again = api_client(admin).post(f"/api/v1/keys/{other.key.pk}/rotate", {}, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "api_key_revoked"


def test_another_teams_key_is_a_404_for_rename_and_rotate(make_tenant, api_client):
    _, mine = make_tenant()
    theirs_tenant, theirs = make_tenant()
    key = ApiKey.objects.get(tenant=theirs_tenant)
    http = api_client(mine)
    assert http.patch(f"/api/v1/keys/{key.pk}", {"name": "x"}, format="json").status_code == 404
    assert http.post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json").status_code == 404
    key.refresh_from_db()
    assert key.name == "test" and key.secret_hash == hash_secret(theirs)


def test_rename_and_rotate_need_the_admin_scope(make_tenant, api_client):
    tenant, secret = make_tenant(scopes=["read", "write"])
    key = ApiKey.objects.get(tenant=tenant)
    http = api_client(secret)
    assert http.patch(f"/api/v1/keys/{key.pk}", {"name": "x"}, format="json").status_code == 403
    assert http.post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json").status_code == 403


def test_last_use_records_the_time_and_the_source_address(make_tenant, client):
    tenant, secret = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    assert (key.last_used_at, key.last_used_from) == (None, None)
    response = client.get(
        "/api/v1/sandboxes", HTTP_AUTHORIZATION=f"Bearer {secret}", REMOTE_ADDR="203.0.113.7"
    )
    assert response.status_code == 200
    key.refresh_from_db()
    assert key.last_used_from == "203.0.113.7" and key.last_used_at is not None
    # a new address is recorded even within the minute's resolution (after the cache)
    forget_cached_keys()
    client.get("/api/v1/sandboxes", HTTP_AUTHORIZATION=f"Bearer {secret}", REMOTE_ADDR="::1")
    key.refresh_from_db()
    assert key.last_used_from == "::1"
    listed = client.get("/api/v1/keys", HTTP_AUTHORIZATION=f"Bearer {secret}").json()
    assert listed["results"][0]["last_used_from"] == "::1"
