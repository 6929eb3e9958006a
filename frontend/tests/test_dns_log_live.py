"""The DNS query log where people look (issue 21): the sandbox page shows what the
sandbox asked the installation's resolver, and an episode keeps what its sandboxes asked
during it as evidence (record, API, export, page) after the sandbox is gone. The names
asked are not allowed, so the resolver answers them itself: nothing leaves the machine."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from django.test import Client as PageClient
from hedgerow import Client

from apps.sandboxes.models import Sandbox, State
from apps.trajectories.models import EpisodeSandbox

pytestmark = pytest.mark.timeout(180)

LOOKUP = (
    "import socket,sys\n"
    "try:\n"
    "    socket.getaddrinfo(sys.argv[1], 443, socket.AF_INET)\n"
    "    print('resolved')\n"
    "except socket.gaierror as e:\n"
    "    print('gai', e.errno)\n"
)


def _signed_in(make_user, username: str, *memberships) -> PageClient:
    make_user(username, *memberships)
    client = PageClient()
    assert client.login(username=username, password=username)
    return client


def test_the_sandbox_page_and_the_episode_show_the_dns_queries(live, make_tenant, make_user):
    tenant, key = make_tenant()
    other, _ = make_tenant()
    page = _signed_in(make_user, "dns-viewer", (tenant, "viewer"))
    outsider = _signed_in(make_user, "dns-outsider", (other, "owner"))
    during = f"exfil-{uuid.uuid4().hex[:10]}.not-allowed.example"
    after = f"later-{uuid.uuid4().hex[:10]}.not-allowed.example"
    with Client(url=live.url, api_key=key, max_retries=1, timeout=90) as hr:
        sb = hr.create_sandbox(egress={"allow": ["pkg.example.org"]})
        with sb.episode(task_id="dns-evidence", harness="t", model="m") as episode:
            ran = sb.exec(["python3", "-c", LOOKUP, during])
            assert ran.stdout.strip() == "gai -2"  # NXDOMAIN, answered by the resolver
        ran = sb.exec(["python3", "-c", LOOKUP, after])  # after the episode closed
        assert ran.stdout.strip() == "gai -2"

        # the sandbox page: both names, denied
        shown = page.get(f"/sandboxes/{sb.id}/")
        assert shown.status_code == 200
        html = shown.content.decode()
        assert 'id="dns-log"' in html
        for name in (during, after):
            assert f'data-dns-name="{name}" data-dns-allowed="false"' in html, name
        assert outsider.get(f"/sandboxes/{sb.id}/").status_code == 404

        # the episode kept what was asked during it, not after
        link = EpisodeSandbox.objects.get(episode__episode_id=episode.id)
        names = [e["name"] for e in link.dns_log or []]
        assert during in names and after not in names
        assert link.dns_log_total == len(link.dns_log or [])
        sb.delete()

    deadline = time.monotonic() + 60
    while Sandbox.objects.filter(external_id=sb.id).exclude(state=State.DELETED).exists():
        assert time.monotonic() < deadline, "the sandbox was not deleted"
        time.sleep(0.2)

    # the evidence outlives the sandbox: API record, export and page
    api = live_api(live, key)
    record = api.get(f"/episodes/{episode.id}").json()
    (entry,) = record["sandboxes"]
    assert [e["name"] for e in entry["dns_log"]] == names
    assert entry["dns_log"][names.index(during)]["allowed"] is False
    exported = api.get("/episodes/export").text
    lines = [json.loads(x) for x in exported.splitlines() if x.strip()]
    (mine,) = [x for x in lines if x["episode_id"] == episode.id]
    assert during in [e["name"] for e in mine["sandboxes"][0]["dns_log"]]
    episode_page = page.get(f"/trajectories/{episode.id}/")
    assert episode_page.status_code == 200, episode_page.status_code
    assert f'data-dns-name="{during}"' in episode_page.content.decode()
    assert after not in episode_page.content.decode()


def live_api(live, key: str):
    import httpx

    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {key}"},
        timeout=90,
        trust_env=False,
    )
