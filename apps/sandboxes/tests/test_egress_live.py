"""Egress through the whole stack: an allowlist sandbox made by the REST API, its DNS
query log over the API, and another tenant kept out of it. The names queried are not
allowed, so the resolver answers them itself: nothing is forwarded off the machine."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

LOOKUP = (
    "import socket\n"
    "try:\n"
    "    socket.getaddrinfo('exfil-abc123.not-allowed.example', 443, socket.AF_INET)\n"
    "    print('resolved')\n"
    "except socket.gaierror as e:\n"
    "    print('gai', e.errno)\n"
)


def _client(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )


def test_the_dns_log_shows_what_the_sandbox_asked_and_only_to_its_tenant(live, make_tenant):
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    http, other = _client(live, secret), _client(live, other_secret)
    created = http.post(
        "/sandboxes", json={"image": "host", "egress": {"allow": ["pkg.example.org"]}}
    )
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["egress"] == {"allow": ["pkg.example.org"], "dns": "filtered"}
    sandbox_id = body["id"]
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).status_code == 200
    ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": ["python3", "-c", LOOKUP]})
    assert ran.status_code == 200, ran.text
    assert ran.json()["stdout"].strip() == "gai -2"  # NXDOMAIN, at once
    log = http.get(f"/sandboxes/{sandbox_id}/dns-log")
    assert log.status_code == 200, log.text
    asked = [e for e in log.json()["results"] if e["name"].endswith("not-allowed.example")]
    assert [(e["name"], e["type"], e["allowed"], e["rcode"]) for e in asked] == [
        ("exfil-abc123.not-allowed.example", "A", False, "NXDOMAIN")
    ]
    assert http.get(f"/sandboxes/{sandbox_id}/dns").json() == log.json()
    hidden = other.get(f"/sandboxes/{sandbox_id}/dns-log")
    assert hidden.status_code == 404
    assert hidden.json()["error"]["code"] == "sandbox_not_found"
    bad = http.get(f"/sandboxes/{sandbox_id}/dns-log", params={"limit": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "limit"
