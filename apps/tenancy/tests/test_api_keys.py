from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.tenancy.models import ApiKey
from apps.tenancy.secrets import hash_secret
from apps.tenancy.services import api_key_create

pytestmark = pytest.mark.django_db


def test_it_stores_only_a_hash_and_a_short_prefix(make_tenant):
    tenant, secret = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    assert key.secret_hash == hash_secret(secret)
    assert secret not in (key.secret_hash, key.prefix)
    assert secret.startswith(key.prefix) and len(key.prefix) < 16


def test_it_authenticates_by_bearer_and_by_x_api_key(make_tenant, client):
    _, secret = make_tenant()
    assert client.get("/api/v1/sandboxes", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 200
    assert client.get("/api/v1/sandboxes", HTTP_X_API_KEY=secret).status_code == 200


def test_it_rejects_missing_unknown_revoked_and_expired_keys(make_tenant, client, api_client):
    tenant, secret = make_tenant()
    missing = client.get("/api/v1/sandboxes")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "not_authenticated"
    unknown = client.get("/api/v1/sandboxes", HTTP_AUTHORIZATION="Bearer hr_nope")
    assert unknown.status_code == 401
    assert unknown.json()["error"]["code"] == "invalid_api_key"

    key = ApiKey.objects.get(tenant=tenant)
    admin = api_client(secret)
    revoked = admin.delete(f"/api/v1/keys/{key.id}")
    assert revoked.status_code == 200
    key.refresh_from_db()
    assert key.revoked_at is not None
    again = api_client(secret).get("/api/v1/sandboxes")
    assert again.status_code == 401
    assert again.json()["error"]["code"] == "api_key_revoked"

    expiring = api_key_create(
        tenant=tenant, name="soon", expires_at=timezone.now() + timedelta(seconds=5)
    )
    ApiKey.objects.filter(pk=expiring.key.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    expired = api_client(expiring.secret).get("/api/v1/sandboxes")
    assert expired.status_code == 401
    assert expired.json()["error"]["code"] == "api_key_expired"


def test_it_shows_the_secret_once_and_never_lists_it(make_tenant, api_client):
    _, secret = make_tenant()
    admin = api_client(secret)
    created = admin.post("/api/v1/keys", {"name": "ci", "scopes": ["read"]}, format="json")
    assert created.status_code == 201
    new_secret = created.json()["secret"]
    listing = admin.get("/api/v1/keys").json()["results"]
    assert new_secret not in str(listing)
    assert {k["name"] for k in listing} == {"test", "ci"}
    assert ApiKey.objects.get(name="ci").scopes == ["read"]


def test_it_refuses_writes_with_a_read_only_key(make_tenant, api_client):
    _, secret = make_tenant(scopes=["read"])
    response = api_client(secret).post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


def test_it_refuses_key_management_without_admin_scope(make_tenant, api_client):
    _, secret = make_tenant(scopes=["read", "write"])
    assert api_client(secret).get("/api/v1/keys").status_code == 403


def test_it_records_last_used_time(make_tenant, api_client):
    tenant, secret = make_tenant()
    assert ApiKey.objects.get(tenant=tenant).last_used_at is None
    api_client(secret).get("/api/v1/sandboxes")
    assert ApiKey.objects.get(tenant=tenant).last_used_at is not None


def test_it_rejects_unknown_scopes(make_tenant, api_client):
    _, secret = make_tenant()
    response = api_client(secret).post(
        "/api/v1/keys", {"name": "x", "scopes": ["root"]}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "scopes"


def test_it_creates_a_tenant_and_key_from_the_command_line(capsys):
    from django.core.management import call_command

    call_command("hedgerow_create_tenant", "cli-team", "--quiet")
    secret = capsys.readouterr().out.strip()
    key = ApiKey.objects.get(tenant__slug="cli-team")
    assert key.secret_hash == hash_secret(secret)
