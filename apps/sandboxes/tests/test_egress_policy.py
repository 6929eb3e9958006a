"""The egress policy: parsing, canonical form, name matching; and the API taking it."""

from __future__ import annotations

from typing import Any

import pytest

from apps.core.egress import EgressError, parse_egress
from apps.sandboxes.models import Sandbox, SandboxEvent


@pytest.mark.parametrize(
    ("value", "code", "fragment"),
    [
        ("some", "invalid_egress", "'none', 'all'"),
        (["a.example.org"], "invalid_egress", "'none', 'all'"),
        ({}, "invalid_egress", "non-empty list"),
        ({"allow": []}, "invalid_egress", "non-empty list"),
        ({"allow": ["a.example.org"], "dns": "open"}, "invalid_egress", "egress.dns"),
        ({"allow": ["a.example.org"], "ports": [1]}, "invalid_egress", "unknown egress key"),
        ({"allow": ["a.example.org"], "match": "host"}, "invalid_egress", "egress.match"),
        ({"allow": [7]}, "invalid_egress", "strings"),
        ({"allow": ["localhost"]}, "invalid_egress", "not a host name"),
        ({"allow": ["*"]}, "invalid_egress", "not a host name"),
        ({"allow": ["a.*.example.org"]}, "invalid_egress", "not a host name"),
        ({"allow": ["-bad.example.org"]}, "invalid_egress", "not a host name"),
        ({"allow": ["10.0.0.0/8"]}, "invalid_egress", "needs a port"),
        ({"allow": ["10.0.0.1"]}, "invalid_egress", "needs a port"),
        ({"allow": ["10.0.0.1/8:443"]}, "invalid_egress", "host bits"),
        ({"allow": ["10.0.0.0/8:0"]}, "invalid_egress", "1-65535"),
        ({"allow": ["10.0.0.0/8:http"]}, "invalid_egress", "1-65535"),
        ({"allow": ["0.0.0.0/0:443"]}, "invalid_egress", "wider than /8"),
        ({"allow": ["fd00::/8:443"]}, "invalid_egress", "IPv4 only"),
        ({"allow": ["169.254.169.254:80"]}, "forbidden_address", "169.254.0.0/16"),
        ({"allow": ["127.0.0.0/8:5432"]}, "forbidden_address", "127.0.0.0/8"),
        ({"allow": [f"h{i}.example.org" for i in range(65)]}, "too_many", "at most 64"),
    ],
)
def test_it_rejects_bad_policies_with_a_reason(value, code, fragment):
    with pytest.raises(EgressError) as caught:
        parse_egress(value)
    assert caught.value.code == code
    assert fragment in caught.value.message


def test_it_canonicalises_and_matches_names():
    policy = parse_egress(
        {
            "allow": [
                "PKG.Example.org",
                "*.git.example.com",
                "10.20.0.0/16:443",
                "pkg.example.org",
                "192.0.2.7:22",
            ]
        }
    )
    assert policy.to_json() == {
        "allow": ["pkg.example.org", "*.git.example.com", "10.20.0.0/16:443", "192.0.2.7:22"],
        "dns": "filtered",
    }
    assert parse_egress(policy.to_json()) == policy
    assert policy.allows_name("pkg.example.org.")
    assert policy.allows_name("PKG.EXAMPLE.ORG")
    assert not policy.allows_name("x.pkg.example.org")
    assert policy.allows_name("a.git.example.com")
    assert policy.allows_name("a.b.git.example.com")
    assert not policy.allows_name("git.example.com")  # a wildcard is below, not at, the name
    assert not policy.allows_name("evilgit.example.com")
    assert not policy.allows_name("example.com")
    assert parse_egress("all").allows_name("anything.example")
    assert not parse_egress("none").allows_name("pkg.example.org")
    assert parse_egress(None).to_json() == "none"
    sni = parse_egress({"allow": ["pkg.example.org"], "match": "sni"})
    assert sni.to_json() == {"allow": ["pkg.example.org"], "dns": "filtered", "match": "sni"}
    assert parse_egress(sni.to_json()) == sni
    assert parse_egress({"allow": ["a.example.org"], "match": "ip"}).to_json() == {
        "allow": ["a.example.org"],
        "dns": "filtered",
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "egress", "network_access"),
    [
        ({}, "none", False),
        ({"network_access": False}, "none", False),
        ({"network_access": True}, "all", True),
        ({"egress": "all"}, "all", True),
        ({"egress": "all", "network_access": True}, "all", True),
        (
            {"egress": {"allow": ["pkg.example.org", "10.20.0.0/16:443"]}},
            {"allow": ["pkg.example.org", "10.20.0.0/16:443"], "dns": "filtered"},
            True,
        ),
    ],
)
def test_the_api_stores_and_shows_the_policy(
    make_tenant, api_client, django_capture_on_commit_callbacks, body, egress, network_access
):
    _, secret = make_tenant()
    with django_capture_on_commit_callbacks(execute=False):
        response = api_client(secret).post(
            "/api/v1/sandboxes", {"image": "host", **body}, format="json"
        )
    assert response.status_code == 201, response.content
    assert (response.json()["egress"], response.json()["network_access"]) == (
        egress,
        network_access,
    )
    sandbox = Sandbox.objects.get()
    assert (sandbox.egress, sandbox.network_access) == (egress, network_access)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"egress": "everything"}, "invalid_egress"),
        ({"egress": {"allow": ["169.254.169.254:80"]}}, "forbidden_address"),
        ({"egress": "none", "network_access": True}, "egress_conflict"),
        ({"egress": "all", "network_access": False}, "egress_conflict"),
    ],
)
def test_the_api_refuses_bad_policies_and_creates_nothing(make_tenant, api_client, body, reason):
    _, secret = make_tenant()
    response = api_client(secret).post(
        "/api/v1/sandboxes", {"image": "host", **body}, format="json"
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert (error["code"], error["field"], error["reason"]) == (
        "validation_error",
        "egress",
        reason,
    )
    assert not Sandbox.objects.exists()
    assert not SandboxEvent.objects.exists()


@pytest.mark.django_db
def test_allowlists_are_refused_where_the_backend_cannot_enforce_them(
    make_tenant, api_client, settings
):
    settings.HEDGEROW_BACKEND = "kubernetes"
    _, secret = make_tenant()
    response = api_client(secret).post(
        "/api/v1/sandboxes",
        {"image": "host", "egress": {"allow": ["pkg.example.org"]}},
        format="json",
    )
    assert response.status_code == 400, response.content
    assert response.json()["error"]["reason"] == "egress_unsupported"
    assert "HEDGEROW_K8S_RESOLVER_IP" in response.json()["error"]["message"]
    assert not Sandbox.objects.exists()


@pytest.mark.django_db
def test_kubernetes_with_its_resolver_takes_allowlists_but_not_sni_matching(
    make_tenant, api_client, settings
):
    settings.HEDGEROW_BACKEND = "kubernetes"
    settings.HEDGEROW_K8S_RESOLVER_IP = "10.96.0.53"
    _, secret = make_tenant()
    refused = api_client(secret).post(
        "/api/v1/sandboxes",
        {"image": "host", "egress": {"allow": ["pkg.example.org"], "match": "sni"}},
        format="json",
    )
    assert refused.status_code == 400, refused.content
    assert refused.json()["error"]["reason"] == "egress_unsupported"
    assert "sni" in refused.json()["error"]["message"]
    assert not Sandbox.objects.exists()
    accepted = api_client(secret).post(
        "/api/v1/sandboxes",
        {"image": "host", "egress": {"allow": ["pkg.example.org"]}},
        format="json",
    )
    assert accepted.status_code in (201, 202), accepted.content
    (sandbox,) = Sandbox.objects.all()
    assert sandbox.egress == {"allow": ["pkg.example.org"], "dns": "filtered"}


def test_quota_patterns_cover_names_below_wildcards_and_cidrs_inside_theirs():
    from apps.core.egress import uncovered

    permitted = parse_egress({"allow": ["*.example.org", "pkg.python.test", "10.0.0.0/8:443"]})
    policy = parse_egress(
        {
            "allow": [
                "pkg.example.org",
                "*.git.example.org",
                "example.org",  # the wildcard is below it, not it
                "pkg.python.test",
                "files.python.test",
                "10.20.0.0/16:443",
                "10.20.0.0/16:80",
                "11.0.0.0/16:443",
            ]
        }
    )
    assert uncovered(policy, permitted) == [
        "example.org",
        "files.python.test",
        "10.20.0.0/16:80",
        "11.0.0.0/16:443",
    ]
    assert uncovered(parse_egress("all"), permitted) == []


@pytest.mark.django_db
def test_the_quota_can_forbid_all_and_limit_allowlists_at_create(make_tenant, api_client):
    from apps.billing.quotas import quota_get

    tenant, secret = make_tenant()
    quota = quota_get(tenant=tenant)
    quota.egress_allow_all = False
    quota.egress_patterns = ["*.example.org"]
    quota.save()
    api = api_client(secret)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"network_access": True}, "egress_allow_all"),
        ({"egress": "all"}, "egress_allow_all"),
        ({"egress": {"allow": ["pkg.example.org", "evil.test"]}}, "egress_patterns"),
    ]
    for body, limit in cases:
        response = api.post("/api/v1/sandboxes", {"image": "host", **body}, format="json")
        assert response.status_code == 403, response.content
        error = response.json()["error"]
        assert (error["code"], error["limit"]) == ("quota_exceeded", limit)
    assert error["current"] == ["evil.test"]
    assert not Sandbox.objects.exists()
    assert not SandboxEvent.objects.exists()


@pytest.mark.django_db
def test_patch_refuses_other_fields_bad_policies_unready_sandboxes_and_outsiders(
    make_tenant, api_client
):
    from apps.sandboxes.models import State
    from apps.sandboxes.tests.factories import make_sandbox

    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    sandbox = make_sandbox(tenant, state=State.PROVISIONING)
    url = f"/api/v1/sandboxes/{sandbox.external_id}"
    api = api_client(secret)
    cases = [
        ({"cpu": 2}, 400, "not_patchable"),
        ({}, 400, "validation_error"),
        ({"egress": "lots"}, 400, "validation_error"),
        ({"egress": "all"}, 409, "sandbox_not_ready"),
    ]
    for body, status, code in cases:
        response = api.patch(url, body, format="json")
        assert response.status_code == status, response.content
        assert response.json()["error"]["code"] == code
    hidden = api_client(other_secret).patch(url, {"egress": "all"}, format="json")
    assert hidden.status_code == 404
    assert hidden.json()["error"]["code"] == "sandbox_not_found"
    sandbox.refresh_from_db()
    assert sandbox.egress == "none"
    assert not SandboxEvent.objects.filter(event="egress_changed").exists()


def test_a_request_given_only_network_access_keeps_its_meaning():
    from apps.sandboxes.services.lifecycle import SandboxRequest

    opened = SandboxRequest(image="host", cpu_millis=500, memory_mib=256, network_access=True)
    assert (opened.egress, opened.network_access) == ("all", True)
    closed = SandboxRequest(image="host", cpu_millis=500, memory_mib=256)
    assert (closed.egress, closed.network_access) == ("none", False)
    listed = SandboxRequest(
        image="host", cpu_millis=500, memory_mib=256, egress={"allow": ["a.example.org"]}
    )
    assert listed.network_access is True
