"""The egress policy and the DNS query log on the sandbox page (issue 24, "the egress
policy and DNS query log" as issue 21 landed), in real Chromium with axe-core and no
sideways scrolling at 1440×900 and 390×844. ``test_dns_log_live.py`` checks the
records and the HTML; this is the browser's view of the same page."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hedgerow import Client
from playwright.sync_api import expect

from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)
from frontend.tests.test_dns_log_live import LOOKUP

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def test_the_sandbox_page_shows_its_egress_policy_and_dns_log(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, key = make_tenant()
    make_user("ebba", (tenant, "viewer"))
    denied = f"exfil-{uuid.uuid4().hex[:10]}.not-allowed.example"
    with Client(url=live.url, api_key=key, max_retries=1, timeout=90) as hr:
        sb = hr.create_sandbox(egress={"allow": ["pkg.example.org"]})
        ran = sb.exec(["python3", "-c", LOOKUP, denied])
        assert ran.stdout.strip() == "gai -2"  # NXDOMAIN, answered by the resolver

        console = Console()
        with chromium() as browser:
            page = new_page(browser, live.url, console)
            sign_in(page, "ebba", "ebba")
            page.goto(f"/sandboxes/{sb.id}/")
            expect(page.locator("#sandbox-header")).to_contain_text("allowlist: pkg.example.org")
            expect(page.get_by_role("heading", name="DNS queries")).to_be_visible()
            row = page.locator(f'#dns-log tr[data-dns-name="{denied}"]')
            expect(row).to_have_attribute("data-dns-allowed", "false")
            expect(row).to_contain_text("denied")
            problems = sideways_overflow(page) + axe_violations(page)
        sb.delete()

    assert problems == []
    assert console.errors == []
