"""Security review of keys, usage, quotas and the staff endpoints: no scope escalation,
one team's money is invisible to another, staff endpoints refuse everyone else, and a
browser session cannot write without its CSRF token."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import T0, book, ledger_sandbox  # noqa: F401 - fixture
from apps.sandboxes.models import Sandbox
from apps.tenancy.models import ApiKey, Membership

pytestmark = pytest.mark.django_db


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    error: dict[str, Any] = response.json()["error"]
    assert {"code", "message", "field"} <= set(error), error
    return error


@pytest.mark.parametrize(
    ("issuer", "asked"),
    [
        (["read", "admin"], ["read", "write"]),
        (["read", "admin"], None),  # the default is read + write
        (["admin"], ["read"]),
    ],
)
def test_it_never_lets_a_key_mint_a_scope_it_lacks(make_tenant, api_client, issuer, asked):
    tenant, secret = make_tenant(scopes=issuer)
    body: dict[str, Any] = {"name": "escalated"}
    if asked is not None:
        body["scopes"] = asked
    error = _error(api_client(secret).post("/api/v1/keys", body, format="json"), 403)
    assert (error["code"], error["field"]) == ("scope_not_held", "scopes")
    assert ApiKey.objects.filter(tenant=tenant).count() == 1


def test_it_lets_a_key_issue_keys_within_its_own_scopes(make_tenant, api_client):
    tenant, secret = make_tenant(scopes=["read", "write", "admin"])
    made = api_client(secret).post(
        "/api/v1/keys", {"name": "ci", "scopes": ["read"]}, format="json"
    )  # fmt: skip
    assert made.status_code == 201, made.content
    assert ApiKey.objects.get(tenant=tenant, name="ci").scopes == ["read"]


def test_it_shows_a_team_only_its_own_usage_and_quota_use(make_tenant, api_client, book):  # noqa: F811
    owner, owner_secret = make_tenant()
    _, outsider_secret = make_tenant()
    ledger_sandbox(owner, T0, [("provisioning", 0), ("deleted", 7200)])
    window = {"start": "2026-03-01", "end": "2026-04-01"}
    mine = api_client(owner_secret).get("/api/v1/usage", window).json()
    assert mine["totals"]["sandboxes"] == 1 and mine["totals"]["cost"] != "0.00"
    outsider = api_client(outsider_secret)
    usage = outsider.get("/api/v1/usage", window).json()
    assert (usage["totals"]["sandboxes"], usage["totals"]["cost"]) == (0, "0.00")
    assert usage["by_image"] == [] and usage["by_label"] == []
    quota = outsider.get("/api/v1/quota").json()
    assert quota["concurrent_sandboxes"]["current"] == 0
    assert owner.slug not in str(usage) + str(quota)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("get", "/api/v1/admin/tenants/{slug}/quota", None),
        ("patch", "/api/v1/admin/tenants/{slug}/quota", {"max_concurrent_sandboxes": 99}),
        ("get", "/api/v1/admin/cost-report", None),
    ],
)
def test_it_refuses_staff_endpoints_to_keys_and_to_team_owners(
    make_tenant, api_client, method, path, body
):
    tenant, secret = make_tenant(scopes=["read", "write", "admin"])
    url = path.format(slug=tenant.slug)
    by_key = getattr(api_client(secret), method)(url, body, format="json")
    assert by_key.status_code in (401, 403)
    assert _error(by_key, by_key.status_code)["code"] in ("not_authenticated", "permission_denied")
    owner = User.objects.create_user("owner-not-staff", password="pw")
    Membership.objects.create(tenant=tenant, user=owner, role="owner")
    session = APIClient()
    session.force_login(owner)
    by_owner = getattr(session, method)(url, body, format="json")
    assert _error(by_owner, 403)["code"] == "permission_denied"
    assert quota_get(tenant=tenant).max_concurrent_sandboxes is None


def test_it_refuses_a_staff_session_write_without_its_csrf_token(make_tenant):
    tenant, _ = make_tenant()
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(staff)
    url = f"/api/v1/admin/tenants/{tenant.slug}/quota"
    assert browser.get(url).status_code == 200
    forged = browser.patch(url, {"max_concurrent_sandboxes": 0}, format="json")
    assert _error(forged, 403)["code"] == "permission_denied"
    assert not TenantQuota.objects.filter(tenant=tenant, max_concurrent_sandboxes=0).exists()


def test_it_refuses_a_team_session_write_without_its_csrf_token(make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    member = User.objects.create_user("member", password="pw")
    Membership.objects.create(tenant=tenant, user=member, role="owner")
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(member)
    assert browser.get("/api/v1/sandboxes").status_code == 200
    for path, body in [("/api/v1/sandboxes", {"image": "host"}), ("/api/v1/keys", {"name": "k"})]:
        forged = browser.post(path, body, format="json")
        assert _error(forged, 403)["code"] == "permission_denied", path
    assert not Sandbox.objects.exists()
    assert ApiKey.objects.filter(tenant=tenant).count() == 1
    assert no_enqueue["provision"] == []


def test_it_shuts_a_disabled_team_out_of_the_api_and_the_pages(make_tenant, api_client):
    from apps.tenancy.auth import forget_cached_keys

    tenant, secret = make_tenant()
    member = User.objects.create_user("member", password="pw")
    Membership.objects.create(tenant=tenant, user=member, role="owner")
    tenant.is_active = False
    tenant.save(update_fields=["is_active"])
    forget_cached_keys()
    assert _error(api_client(secret).get("/api/v1/sandboxes"), 401)["code"] == "tenant_disabled"
    browser = APIClient()
    browser.force_login(member)
    assert browser.get("/api/v1/sandboxes").status_code in (401, 403)
    assert browser.get("/sandboxes/").status_code == 403
    assert browser.get("/billing/usage/").status_code == 403
