"""Snapshots in the dashboard (issue 16): a sandbox's snapshots, the snapshot page with
its fingerprint, the fork dialog, and a child's divergence diff. Real Chromium, real
sandboxes, axe-core on each screen."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from frontend.tests.browser import Console, axe_violations, chromium, new_page, sign_in
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("assets")]


def _captured(http: httpx.Client, sandbox_id: str, **body: Any) -> dict[str, Any]:
    made = http.post(f"/sandboxes/{sandbox_id}/snapshots", json=body)
    assert made.status_code == 202, made.text
    deadline = time.monotonic() + 60
    while (snap := http.get(f"/snapshots/{made.json()['id']}").json())["state"] == "capturing":
        assert time.monotonic() < deadline, "the capture did not finish"
        time.sleep(0.1)
    assert snap["state"] == "ready", snap
    return dict(snap)


def _settled(http: httpx.Client, sandbox_ids: list[str]) -> None:
    deadline = time.monotonic() + 120
    for sandbox_id in sandbox_ids:
        while http.get(f"/sandboxes/{sandbox_id}").json()["state"] in (
            "requested",
            "provisioning",
        ):
            assert time.monotonic() < deadline, f"{sandbox_id} did not settle"
            time.sleep(0.1)


def test_it_shows_snapshots_forks_children_and_their_divergence(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, secret = make_tenant()
    other, other_secret = make_tenant()
    make_user("sorrel", (tenant, "member"))
    make_user("tansy", (tenant, "viewer"))
    http = _api(live, secret)
    parent = _create_ready(http)
    wrote = http.post(f"/sandboxes/{parent}/exec", json={"command": "echo s7 > /workspace/s"})
    assert wrote.status_code == 200 and wrote.json()["exit_code"] == 0
    steady = _captured(
        http,
        parent,
        name="step-7",
        manifest={"seed": 7},
        probes=[{"name": "state", "command": "cat /workspace/s"}],
        volatile=["env:LANG"],
    )
    moving = _captured(
        http, parent, name="clock", probes=[{"name": "clock", "command": "date +%s%N"}]
    )
    foreign = _captured(_api(live, other_secret), _create_ready(_api(live, other_secret)))

    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "sorrel", "sorrel")
        page.goto(f"/sandboxes/{parent}/")
        panel = page.locator("#snapshots")
        expect(panel.locator("tr[data-snapshot-id]")).to_have_count(2)
        assert axe_violations(page) == []
        panel.get_by_role("link", name="step-7").click()

        # the snapshot page: its fingerprint, probes and manifest
        expect(page.get_by_role("heading", name="step-7")).to_be_visible()
        expect(page.locator("[data-tree]")).to_contain_text("sha256:")
        expect(page.locator('tr[data-probe="state"]')).to_contain_text("s7")
        expect(page.get_by_label("Manifest JSON")).to_contain_text('"seed": 7')
        expect(page.locator(".chip", has_text="env:LANG")).to_be_visible()
        assert axe_violations(page) == []

        # the fork dialog: K children, all verified
        page.locator("#fork-dialog summary").click()
        page.get_by_label("Number of children").fill("2")
        page.get_by_role("button", name="Fork", exact=True).click()
        expect(page.locator(".flash")).to_contain_text("Forked 2 sandboxes")
        children = [
            str(c.get_attribute("data-child")) for c in page.locator("tr[data-child]").all()
        ]
        assert len(children) == 2
        _settled(http, children)
        page.reload()
        expect(page.locator("tr[data-child] .badge", has_text="ready")).to_have_count(2)
        # over a limit: refused whole, said on the page, nothing created
        page.locator("#fork-dialog summary").click()
        page.get_by_label("Number of children").fill("65")
        page.get_by_label("Number of children").evaluate("e => e.removeAttribute('max')")
        page.get_by_role("button", name="Fork", exact=True).click()
        expect(page.locator(".flash-error")).to_contain_text("Fork refused")
        expect(page.locator("tr[data-child]")).to_have_count(2)

        # a child that is not the state: its divergence, on the snapshot and its own page
        page.goto(f"/snapshots/{moving['id']}/")
        page.locator("#fork-dialog summary").click()
        page.get_by_label("Number of children").fill("1")
        page.get_by_role("button", name="Fork", exact=True).click()
        expect(page.locator(".flash")).to_contain_text("Forked 1 sandbox")
        (child,) = [
            str(c.get_attribute("data-child")) for c in page.locator("tr[data-child]").all()
        ]
        _settled(http, [child])
        page.reload()
        row = page.locator(f'tr[data-child="{child}"]')
        expect(row.locator(".badge")).to_have_text("failed")
        expect(row.locator("[data-divergence]")).to_contain_text("probe clock")
        assert axe_violations(page) == []
        row.get_by_role("link", name=child).click()
        expect(page.get_by_role("heading", name="Not the snapshot's state")).to_be_visible()
        expect(page.locator("[data-divergence]")).to_contain_text("expected exit 0")
        assert axe_violations(page) == []

        # another team's snapshot does not exist here
        assert page.request.get(f"{live.url}/snapshots/{foreign['id']}/").status == 404
        # and a viewer cannot fork (the server refuses, whatever the page shows)

        # a viewer sees it all, and no fork dialog
        viewer = new_page(browser, live.url, console)
        sign_in(viewer, "tansy", "tansy")
        viewer.goto(f"/snapshots/{steady['id']}/")
        expect(viewer.get_by_role("heading", name="step-7")).to_be_visible()
        expect(viewer.locator("#fork-dialog")).to_have_count(0)
        token = viewer.locator("input[name=csrfmiddlewaretoken]").first.get_attribute("value")
        refused = viewer.request.post(
            f"{live.url}/snapshots/{steady['id']}/fork",
            form={"count": "1", "csrfmiddlewaretoken": str(token)},
            headers={"Referer": f"{live.url}/snapshots/{steady['id']}/"},
        )
        assert refused.status == 403
    assert console.errors == []
