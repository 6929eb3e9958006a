"""Dead ends in Chromium at 1440x900 and 390x844 (issue 24, defect 10): a team member
opening the cost report gets the styled 403 with a way back (not the admin sign-in),
a staff user without a team gets a page naming what staff can open, an unknown page
is the styled 404; each fits both screens and passes axe."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from frontend.tests.browser import (
    DESKTOP,
    PHONE,
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def _unexpected(console: Console, *refused: str) -> list[str]:
    """Console errors other than Chromium's note that a page we meant to refuse (403 or
    404: the status is the point) failed to load."""
    return [
        e
        for e in console.errors
        if not (("status of 403" in e or "status of 404" in e) and any(r in e for r in refused))
    ]


def _fits_and_passes_axe(page: Page) -> None:
    assert sideways_overflow(page) == []
    for size in (DESKTOP, PHONE):
        page.set_viewport_size(size)
        assert axe_violations(page) == [], size


def test_a_member_on_the_cost_report_gets_a_styled_403_with_a_way_back(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    make_user("mira", (tenant, "owner"))
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "mira", "mira")
        response = page.goto("/billing/staff/costs/")
        assert response is not None and response.status == 403
        assert "/admin/login" not in page.url  # never the admin sign-in that cannot help
        card = page.locator("#staff-only")
        expect(card.get_by_role("heading")).to_have_text(
            "This page is for the installation's staff"
        )
        expect(card).to_contain_text("signed in as mira")
        _fits_and_passes_axe(page)
        card.get_by_role("link", name="Back to your dashboard").click()
        page.wait_for_url("**/sandboxes/")
        expect(page.get_by_role("heading", name="Sandboxes", exact=True)).to_be_visible()

        response = page.goto("/no/such/page/")
        assert response is not None and response.status == 404
        card = page.locator("#not-found")
        expect(card).to_contain_text("/no/such/page/")
        _fits_and_passes_axe(page)
        card.get_by_role("link", name="Back to your dashboard").click()
        page.wait_for_url("**/sandboxes/")
    assert _unexpected(console, "/billing/staff/costs/", "/no/such/page/") == []


def test_staff_without_a_team_get_a_page_naming_what_staff_can_open(live: Any) -> None:
    User.objects.create_user("root", password="root", is_staff=True)
    User.objects.create_user("newbie", password="newbie")
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "root", "root")  # lands on /sandboxes/: no team to show
        card = page.locator("#no-team")
        expect(card).to_contain_text("the installation's staff, but not a member of any team")
        links = card.locator("#staff-links")
        expect(links.get_by_role("link")).to_have_text(
            ["Cost report", "Leak report", "Teams in the admin"]
        )
        _fits_and_passes_axe(page)
        links.get_by_role("link", name="Cost report").click()
        page.wait_for_url("**/billing/staff/costs/")
        expect(page.get_by_role("heading", name="Cost report")).to_be_visible()
        page.go_back()
        card.locator("#staff-links").get_by_role("link", name="Leak report").click()
        page.wait_for_url("**/reports/leaks")
        expect(page.get_by_role("heading", name="Leak report")).to_be_visible()

        other = new_page(browser, live.url, console)
        sign_in(other, "newbie", "newbie")
        card = other.locator("#no-team")
        expect(card).to_contain_text("Ask an owner or admin of your team to add newbie")
        expect(card.locator("#staff-links")).to_have_count(0)
        _fits_and_passes_axe(other)
    assert _unexpected(console, "/sandboxes/") == []
