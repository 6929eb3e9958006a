"""Pause and Resume on the sandbox page (issue 24, "snapshots/fork/pause/resume" as
issue 16 landed): a member pauses a ready sandbox (post/redirect/get), its state is
captured by the worker, the page offers Resume, and the resumed sandbox has its files
back. Viewers get no buttons and a 403; a refusal (not ready) is a message and changes
nothing. Real sandbox, real worker, real Chromium with axe-core and no sideways
scrolling at 1440×900 and 390×844.

Rows are checked outside the browser (Playwright's sync API runs an event loop, under
which Django refuses ORM calls)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from playwright.sync_api import expect

from apps.sandboxes.models import Sandbox, Snapshot, State
from apps.sandboxes.tests.faults import until
from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("assets")]


def _pause_captured(sandbox_id: str) -> bool:
    sandbox = Sandbox.objects.get(external_id=sandbox_id)
    return (
        sandbox.state == State.PAUSED
        and Snapshot.objects.filter(sandbox=sandbox, kind="pause", state="ready").exists()
    )


def test_a_member_pauses_and_resumes_a_sandbox_from_its_page(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, secret = make_tenant()
    make_user("pia", (tenant, "member"))
    make_user("val", (tenant, "viewer"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http)
    wrote = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "echo kept > /workspace/k"})
    assert wrote.status_code == 200 and wrote.json()["exit_code"] == 0
    page_url = f"/sandboxes/{sandbox_id}/"

    viewer = Client()
    assert viewer.login(username="val", password="val")
    assert 'action="/sandboxes/' + sandbox_id + '/pause"' not in viewer.get(page_url).text
    assert viewer.post(f"{page_url}pause").status_code == 403

    member = Client()
    assert member.login(username="pia", password="pia")
    assert 'action="/sandboxes/' + sandbox_id + '/pause"' in member.get(page_url).text
    # resuming a sandbox that is not paused: a message, a redirect, nothing changes
    refused = member.post(f"{page_url}resume")
    assert refused.status_code == 302 and refused["Location"] == page_url
    assert "was not resumed" in member.get(page_url).text
    assert Sandbox.objects.get(external_id=sandbox_id).state == State.READY

    paused = member.post(f"{page_url}pause")
    assert paused.status_code == 302 and paused["Location"] == page_url
    assert "Pausing " + sandbox_id in member.get(page_url).text
    until(lambda: _pause_captured(sandbox_id), 120, "the pause to be captured")

    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "pia", "pia")
        page.goto(page_url)
        header = page.locator("#sandbox-header")
        expect(header.get_by_role("button", name="Pause")).to_have_count(0)
        problems = sideways_overflow(page) + axe_violations(page)
        header.get_by_role("button", name="Resume").click()
        expect(page.locator(".flash").first).to_contain_text(f"Resuming {sandbox_id}")
        expect(page).to_have_url(f"{live.url}{page_url}")  # redirected: a reload re-reads
        # ready again: the page reloads itself to gain its terminal and files panels
        expect(page.locator('[data-sandbox-id][data-state="ready"]')).to_have_count(
            1, timeout=120_000
        )
        page.wait_for_load_state()
        expect(header.get_by_role("button", name="Pause")).to_be_visible()
        problems += axe_violations(page)

    assert problems == []
    assert console.errors == []
    back = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "cat /workspace/k"})
    assert back.status_code == 200 and back.json()["stdout"] == "kept\n", back.text
    assert Sandbox.objects.get(external_id=sandbox_id).generation == 2
