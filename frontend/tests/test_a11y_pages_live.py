"""Issue 24, defect 12: the pages the other browser tests do not reach, under axe-core
at 1440×900 and 390×844 (serious or critical violations fail) and without sideways
scrolling: the staff cost report and leak report, the sign-in page, the styled 404,
"no team", "you need another role" and "staff only". Each page family's own browser
tests run the same checks on theirs (test_screens_live.py lists the team pages).

Rows are set up before the browser opens (Playwright's sync API runs an event loop,
under which Django refuses ORM calls)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from apps.billing.tests.test_costs import ledger_sandbox
from frontend.tests.browser import Console, axe_violations, chromium, new_page, sideways_overflow

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.usefixtures("assets"),
]


def _check(page: Page, path: str, status: int, text: str, found: dict[str, list[str]]) -> None:
    response = page.goto(path)
    assert response is not None and response.status == status, (path, response)
    expect(page.locator("main, body").first).to_contain_text(text)
    found[path] = sideways_overflow(page) + axe_violations(page)


def test_staff_error_and_sign_in_pages_pass_axe_at_both_sizes(live, make_tenant, make_user):
    from datetime import timedelta

    from django.utils import timezone

    from apps.billing.pricing import price_books_ensure

    price_books_ensure()  # transactional tests flush the seed migration's rows
    tenant, _ = make_tenant(slug="rl-lab")
    other, _ = make_tenant(slug="eval-infra")
    day = timezone.now().replace(hour=8, minute=0, second=0, microsecond=0) - timedelta(days=1)
    for t, hours in ((tenant, 2), (other, 5)):
        ledger_sandbox(
            t, day, [("provisioning", 1), ("ready", 3), ("deleted", 3600 * hours)], image="host"
        )
    make_user("noor", (tenant, "viewer"))
    User.objects.create_user("root", password="root", is_staff=True)  # staff, no team

    found: dict[str, list[str]] = {}
    with chromium() as browser:
        anonymous = new_page(browser, live.url, Console())  # a 404 logs its status
        _check(anonymous, "/login/", 200, "Sign in", found)
        _check(anonymous, "/no/such/page/", 404, "Nothing here", found)

        staff_console = Console()
        staff = new_page(browser, live.url, staff_console)
        staff.goto("/login/")
        staff.get_by_label("Username").fill("root")
        staff.get_by_label("Password").fill("root")
        staff.get_by_role("button", name="Sign in").click()
        staff.wait_for_load_state("networkidle")
        _check(staff, "/sandboxes/", 403, "not in a team", found)  # staff without a team
        _check(staff, "/billing/staff/costs/", 200, "Cost report", found)
        expect(staff.locator("#cost-table tbody tr")).to_have_count(2)
        _check(staff, "/reports/leaks", 200, "Leak report", found)

        viewer = new_page(browser, live.url, Console())  # both pages are 403s
        viewer.goto("/login/")
        viewer.get_by_label("Username").fill("noor")
        viewer.get_by_label("Password").fill("noor")
        viewer.get_by_role("button", name="Sign in").click()
        viewer.wait_for_url("**/sandboxes/")
        _check(
            viewer, "/keys/", 403, "Your role cannot open this page", found
        )  # a viewer: "needs another role"
        _check(viewer, "/billing/staff/costs/", 403, "staff", found)  # not staff
    assert {path: problems for path, problems in found.items() if problems} == {}
    # the staff pages that answer 200 log nothing (the no-team page's 403 is its status)
    assert [e for e in staff_console.errors if "status of 403" not in e] == []
