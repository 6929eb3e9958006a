"""One window rule in Chromium (issue 24, defect 1), at 1440x900 and 390x844: pressing
Show with today as the end date (and as the start: a single day) counts today on the
Usage page, and the cost report, its sort links and its CSV count the same day.

Rows are set up before the browser opens (Playwright's loop and the ORM don't mix)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import ViewportSize, expect

from apps.billing.reports import tenant_report
from apps.billing.tests.test_costs import ledger_sandbox
from apps.tenancy.services import membership_set_role
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

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.usefixtures("seeded_price_books", "assets"),
]


@pytest.fixture
def assets() -> None:
    from frontend.tests.browser import ROOT

    if not (ROOT / "frontend" / "static" / "dist" / "main.js").exists():
        pytest.fail("frontend assets are not built: run `scripts/stack.sh install`")


@pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_today_as_the_end_date_counts_today_everywhere(
    live: Any, make_tenant: Any, size: ViewportSize
) -> None:
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    # an hour today, and one yesterday that a today-only window must leave out
    ledger_sandbox(tenant, midnight, [("provisioning", 0), ("deleted", 3600)], image="today")
    ledger_sandbox(tenant, midnight - timedelta(days=1), [("provisioning", 0), ("deleted", 3600)])
    ledger_sandbox(other, midnight, [("provisioning", 0), ("deleted", 1800)])
    today = midnight.date().isoformat()
    expected = tenant_report(tenant=tenant, start=midnight, end=midnight + timedelta(days=1))
    cost = expected.as_dict()["totals"]["cost"]
    assert Decimal("0.01") <= Decimal(cost) < 1000 and expected.totals.sandboxes == 1
    user = User.objects.create_user("ana", password="ana")
    membership_set_role(tenant=tenant, user=user, role="member")
    User.objects.create_user("root", password="root", is_staff=True)
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.set_viewport_size(size)
        sign_in(page, "ana", "ana")
        page.goto("/billing/usage/")
        page.get_by_label("From", exact=True).fill(today)
        page.get_by_label("To", exact=True).fill(today)
        page.get_by_role("button", name="Show").click()
        page.wait_for_url(f"**/billing/usage/?start={today}&end={today}")
        expect(page.locator("#total-cost")).to_have_text(f"${cost}")
        expect(page.locator(".flash-error")).to_have_count(0)  # a single day is a window
        expect(page.locator("#by-image tbody tr")).to_have_count(1)
        expect(page.locator("#by-image tbody tr td").first).to_have_text("today")
        # the form shows the window it counted: pressing Show again changes nothing
        expect(page.get_by_label("To", exact=True)).to_have_value(today)
        page.get_by_role("button", name="Show").click()
        page.wait_for_url(f"**/billing/usage/?start={today}&end={today}")
        expect(page.locator("#total-cost")).to_have_text(f"${cost}")
        assert sideways_overflow(page) == []
        page.set_viewport_size(size)
        assert axe_violations(page) == []

        staff_console = Console()
        staff = new_page(browser, live.url, staff_console)
        staff.set_viewport_size(size)
        sign_in(staff, "root", "root")  # staff without a team land on the no-team 403
        staff_console.errors.clear()
        staff.goto("/billing/staff/costs/")
        staff.get_by_label("From", exact=True).fill(today)
        staff.get_by_label("To", exact=True).fill(today)
        staff.get_by_role("button", name="Show").click()
        rows = staff.locator("#cost-table tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.first).to_have_attribute("data-tenant", tenant.slug)  # -cost: 1 h > ½ h
        expect(staff.locator("#total-cost")).not_to_have_text("$0.00")
        staff.locator('th a[data-sort="cost"]').click()  # ascending, same window
        expect(rows.first).to_have_attribute("data-tenant", other.slug)
        expect(rows).to_have_count(2)
        assert f"start={today}&end={today}" in staff.url
        with staff.expect_download() as download:
            staff.locator("#csv-link").click()
        content = open(download.value.path()).read()  # noqa: SIM115 - tiny file
        assert sideways_overflow(staff) == []
        staff.set_viewport_size(size)
        assert axe_violations(staff) == []
    table = [line.split(",") for line in content.splitlines()]
    header = table[0]
    by_tenant = {row[0]: row[header.index("cost")] for row in table[1:]}
    assert by_tenant == {other.slug: by_tenant[other.slug], tenant.slug: cost}
    assert [row[0] for row in table[1:]] == [other.slug, tenant.slug]  # the sort it showed
    assert console.errors == [] and staff_console.errors == []
