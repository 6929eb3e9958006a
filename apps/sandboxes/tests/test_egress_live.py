"""Egress through the whole stack: an allowlist sandbox made by the REST API, its DNS
query log over the API, and another tenant kept out of it. The names queried are not
allowed, so the resolver answers them itself: nothing is forwarded off the machine."""

from __future__ import annotations

import json

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


CONNECT = (
    "import socket,sys\n"
    "for t in sys.argv[1:]:\n"
    "    h,p=t.rsplit(':',1); s=socket.socket(); s.settimeout(2)\n"
    "    try:\n"
    "        s.connect((h,int(p))); print(t,'open')\n"
    "    except OSError as e:\n"
    "        print(t,'refused')\n"
    "    finally:\n"
    "        s.close()\n"
)


def test_patch_changes_a_live_sandbox_and_the_ledger_records_it(live, make_tenant):
    from apps.sandboxes.backends.tests.egress_internet import internet
    from apps.sandboxes.models import SandboxEvent

    _, secret = make_tenant()
    http = _client(live, secret)
    with internet() as net:
        a, b = f"{net.a}:8080", f"{net.b}:8080"
        created = http.post("/sandboxes", json={"image": "host", "egress": {"allow": [a]}})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["id"]
        assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).status_code == 200

        def opened() -> set[str]:
            ran = http.post(
                f"/sandboxes/{sandbox_id}/exec", json={"command": ["python3", "-c", CONNECT, a, b]}
            )
            assert ran.status_code == 200, ran.text
            lines = [line.split() for line in ran.json()["stdout"].splitlines()]
            return {t for t, result in lines if result == "open"}

        assert opened() == {a}
        patched = http.patch(f"/sandboxes/{sandbox_id}", json={"egress": {"allow": [b]}})
        assert patched.status_code == 200, patched.text
        assert patched.json()["egress"] == {"allow": [b], "dns": "filtered"}
        assert opened() == {b}
        closed = http.patch(f"/sandboxes/{sandbox_id}", json={"egress": "none"})
        assert (closed.status_code, closed.json()["network_access"]) == (200, False)
        assert opened() == set()
    events = SandboxEvent.objects.filter(event="egress_changed").order_by("at", "id")
    allow_a = {"allow": [a], "dns": "filtered"}
    allow_b = {"allow": [b], "dns": "filtered"}
    assert [(json.loads(e.message), e.reason) for e in events] == [
        ({"from": allow_a, "to": allow_b}, "api"),
        ({"from": allow_b, "to": "none"}, "api"),
    ]
    log = http.get(f"/sandboxes/{sandbox_id}/events").json()["results"]
    assert [e["event"] for e in log].count("egress_changed") == 2
