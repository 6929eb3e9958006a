"""Server-side page rules without a browser: roles, tenancy, validation."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.sandboxes.models import Sandbox
from apps.tenancy.models import Membership

pytestmark = pytest.mark.django_db


def _signed_in(make_user, username: str, *memberships) -> Client:
    make_user(username, *memberships)
    client = Client()
    assert client.login(username=username, password=username)
    return client


def test_it_redirects_anonymous_visitors_to_sign_in(client):
    response = client.get("/sandboxes/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=/sandboxes/")


def test_it_renders_every_page_for_an_owner(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "owner1", (tenant, "owner"))
    for path in ("/sandboxes/", "/sandboxes/table", "/keys/", "/members/"):
        response = client.get(path)
        assert response.status_code == 200, (path, response.content[:500])
    assert client.get("/").status_code == 302


def test_it_shows_inline_errors_from_the_api_validation(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "member1", (tenant, "member"))
    response = client.post("/sandboxes/new", {"image": "host", "memory": "16", "cpu": "1"})
    assert response.status_code == 400
    assert b"at least 32Mi memory" in response.content
    assert not Sandbox.objects.filter(tenant=tenant).exists()


def test_it_refuses_writes_from_a_viewer(make_tenant, make_user):
    tenant, _ = make_tenant()
    client = _signed_in(make_user, "viewer1", (tenant, "viewer"))
    make_user("someone")
    assert client.post("/sandboxes/new", {"image": "host"}).status_code == 403
    assert client.get("/keys/").status_code == 403
    added = client.post("/members/", {"action": "add", "username": "someone", "role": "admin"})
    assert added.status_code == 403
    assert not Sandbox.objects.filter(tenant=tenant).exists()
    assert Membership.objects.filter(tenant=tenant).count() == 1


def test_it_keeps_the_last_owner_and_lets_only_owners_grant_owner(make_tenant, make_user):
    tenant, _ = make_tenant()
    owner = _signed_in(make_user, "own", (tenant, "owner"))
    admin = _signed_in(make_user, "adm", (tenant, "admin"))
    own_id = Membership.objects.get(tenant=tenant, user__username="own").pk
    adm_id = Membership.objects.get(tenant=tenant, user__username="adm").pk
    demote = owner.post("/members/", {"action": "role", "membership_id": own_id, "role": "member"})
    assert demote.status_code == 200
    assert b"a team needs at least one owner" in demote.content
    promote = admin.post("/members/", {"action": "role", "membership_id": adm_id, "role": "owner"})
    assert promote.status_code == 403
    roles = dict(Membership.objects.filter(tenant=tenant).values_list("user__username", "role"))
    assert roles == {"own": "owner", "adm": "admin"}


def test_it_switches_only_to_teams_the_user_belongs_to(make_tenant, make_user):
    mine, _ = make_tenant()
    theirs, _ = make_tenant()
    client = _signed_in(make_user, "switcher", (mine, "member"))
    client.post("/team/switch", {"tenant_id": str(theirs.pk), "next": "/sandboxes/"})
    assert client.session.get("tenant_id") != str(theirs.pk)
    response = client.get("/sandboxes/")
    assert response.context["tenant"] == mine


def test_it_renders_a_sandbox_page_and_hides_another_teams_as_404(make_tenant, make_user):
    from apps.sandboxes.tests.factories import make_sandbox

    mine, _ = make_tenant()
    theirs, _ = make_tenant()
    own = make_sandbox(mine, state="provisioning", labels={"task": "t1"})
    other = make_sandbox(theirs, external_id="sb-theirs")
    client = _signed_in(make_user, "reader", (mine, "viewer"))
    page = client.get(f"/sandboxes/{own.external_id}/")
    assert page.status_code == 200
    assert b"Waiting for the sandbox" in page.content
    assert b"task=t1" in page.content
    for path in ("/", "header", "timeline", "operations", "files"):
        url = f"/sandboxes/{other.external_id}/{path.strip('/')}"
        assert client.get(url).status_code == 404, url
    listing = client.get("/sandboxes/table")
    assert own.external_id.encode() in listing.content
    assert b"sb-theirs" not in listing.content


def _sandbox(tenant, external_id: str, state: str) -> Sandbox:
    from datetime import timedelta

    from django.utils import timezone

    return Sandbox.objects.create(
        tenant=tenant,
        external_id=external_id,
        state=state,
        image="host",
        cpu_millis=1000,
        memory_mib=512,
        ttl_seconds=600,
        expires_at=timezone.now() + timedelta(minutes=10),
        backend="local",
    )


def test_it_rereads_the_quota_strip_with_the_teams_live_sandboxes_only(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    client = _signed_in(make_user, "quota1", (tenant, "member"))
    page = client.get("/sandboxes/").content.decode()
    assert 'hx-get="/sandboxes/quota"' in page and "data-live-sandboxes" in page
    _sandbox(tenant, "sb-a", "ready")
    _sandbox(tenant, "sb-b", "provisioning")
    _sandbox(tenant, "sb-gone", "deleted")
    _sandbox(other, "sb-theirs", "ready")
    strip = client.get("/sandboxes/quota")
    assert strip.status_code == 200
    html = strip.content.decode()
    assert 'id="quota-live"' in html and "<html" not in html
    concurrent = html.split('data-quota="concurrent_sandboxes"', 1)[1].split("</li>", 1)[0]
    assert "2 / " in concurrent and "2000m" in html


def test_a_team_switch_to_a_non_uuid_is_a_typed_400(make_tenant, make_user):
    mine, _ = make_tenant()
    client = _signed_in(make_user, "badswitch", (mine, "member"))
    client.raise_request_exception = False
    for bad in ("not-a-uuid", "1' OR 1=1", "x" * 5000):
        response = client.post("/team/switch", {"tenant_id": bad, "next": "/sandboxes/"})
        assert response.status_code == 400, response.content[:200]
        assert response.content.startswith(b"invalid_team:")
    # The session kept the team it had, and pages still work.
    assert client.get("/sandboxes/").context["tenant"] == mine


def test_issuing_a_key_redirects_and_shows_the_secret_once(make_tenant, make_user):
    """Post/redirect/get: the POST answers a redirect (a reload cannot mint a second
    key), the next GET shows the secret, the one after does not; it is never in the
    redirect's URL."""
    from apps.tenancy.models import ApiKey

    tenant, _ = make_tenant()
    client = _signed_in(make_user, "prg", (tenant, "owner"))
    answer = client.post("/keys/", {"name": "ci", "scopes": ["read"], "expires_in_days": ""})
    assert answer.status_code == 302 and answer["Location"] == "/keys/"
    first = client.get("/keys/").content.decode()
    key = ApiKey.objects.get(tenant=tenant, name="ci")
    assert 'id="new-key-secret"' in first and key.prefix in first
    assert 'id="new-key-secret"' not in client.get("/keys/").content.decode()
    assert ApiKey.objects.filter(tenant=tenant, name="ci").count() == 1


def test_the_sandbox_header_names_its_egress_policy(make_tenant, make_user):
    from apps.sandboxes.tests.factories import make_sandbox

    mine, _ = make_tenant()
    client = _signed_in(make_user, "reader", (mine, "viewer"))
    cases = [
        ("none", b"no egress"),
        ("all", b"outbound allowed"),
        (
            {"allow": ["pkg.example.org", "10.0.0.0/8:443"], "dns": "filtered"},
            b"allowlist: pkg.example.org, 10.0.0.0/8:443",
        ),
    ]
    for n, (egress, shown) in enumerate(cases):
        sandbox = make_sandbox(mine, external_id=f"sb-net-{n}")
        Sandbox.objects.filter(pk=sandbox.pk).update(egress=egress)
        header = client.get(f"/sandboxes/{sandbox.external_id}/header")
        assert header.status_code == 200
        assert shown in header.content, header.content
