"""The Usage page and the staff cost report in real Chromium against the live stack.

Rows are set up before the browser opens (Playwright's loop and the ORM don't mix)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import expect

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.billing.reports import tenant_report
from apps.billing.tests.test_costs import ledger_sandbox
from apps.tenancy.services import membership_set_role
from frontend.tests.browser import (
    DESKTOP,
    PHONE,
    ROOT,
    Console,
    chromium,
    new_page,
    screenshot,
    sign_in,
)

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.usefixtures("seeded_price_books"),
]


@pytest.fixture(autouse=True)
def _assets() -> None:
    if not (ROOT / "frontend" / "static" / "dist" / "main.js").exists():
        pytest.fail("frontend assets are not built: run `scripts/stack.sh install`")


def _page_errors(console: Console) -> list[str]:
    # The landing page after sign-in (not ours) has no icon link, so Chromium may fetch
    # /favicon.ico late; that 404 is not an error of the billing pages.
    return [e for e in console.errors if "/favicon.ico" not in e]


def _history(tenant, days: int = 6) -> None:
    """A week of rollouts: two images, an experiment label, one failed start."""
    today = timezone.now().replace(hour=8, minute=0, second=0, microsecond=0)
    for d in range(days, 0, -1):
        start = today - timedelta(days=d)
        for n in range(d % 3 + 1):
            ledger_sandbox(
                tenant,
                start + timedelta(minutes=20 * n),
                [("provisioning", 1), ("ready", 3), ("deleted", 1800 + 900 * n)],
                cpu_millis=2000,
                memory_mib=4096,
                image="python-3.12" if n % 2 else "host",
                labels={"exp": f"rl-{d % 2}"},
            )
    ledger_sandbox(
        tenant, today - timedelta(days=1), [("provisioning", 1), ("failed", 60)], image="host"
    )


def test_it_shows_usage_charts_budget_and_hosted_comparison(live, make_tenant):
    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        monthly_budget=Decimal("5.00"), max_concurrent_sandboxes=20, max_cpu_millis=16000
    )
    _history(tenant)
    user = User.objects.create_user("ana", password="ana")
    membership_set_role(tenant=tenant, user=user, role="member")
    now = timezone.now()
    start = (now - timedelta(days=30)).replace(hour=0, minute=0, second=0, microsecond=0)
    expected = tenant_report(tenant=tenant, start=start, end=now).as_dict()
    assert Decimal(expected["totals"]["cost"]) > 0
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "ana", "ana")
        console.errors.clear()  # only this page's errors count here
        page.goto("/billing/usage/")
        expect(page.locator('nav a[aria-current="page"]')).to_have_text("Usage")
        expect(page.get_by_role("heading", name="Usage", exact=True)).to_be_visible()
        expect(page.locator("#total-cost")).to_have_text(f"${expected['totals']['cost']}")
        for provider in ("e2b", "daytona", "modal"):
            expect(page.locator(f'[data-provider="{provider}"]')).to_be_visible()
        expect(page.locator("#budget [role=meter]")).to_be_visible()
        expect(page.locator("#month-budget")).to_have_text("$5.00")
        expect(page.locator('[data-quota="concurrent_sandboxes"]')).to_contain_text("/ 20")
        expect(page.locator("#by-image tbody tr")).to_have_count(2)
        # Chart.js drew every chart (per day ×2, peak concurrency, by image, by label):
        # canvases marked mounted.
        expect(page.locator("canvas[data-mounted=yes]")).to_have_count(5)
        expect(page.locator('#concurrency canvas[data-mounted="yes"]')).to_have_count(1)
        page.wait_for_timeout(1500)  # let Chart.js finish its grow-in animation (picture only)
        screenshot(page, "billing-usage")
        # On a phone, before Chart.js re-fits its canvases (a beat after the resize,
        # longer on a loaded machine), they still have their desktop pixel width: that
        # must not make the page scroll sideways. Checked in one script run, so no
        # re-fit can happen in between.
        page.set_viewport_size(PHONE)
        widths = page.evaluate(
            """(w) => {
              for (const c of document.querySelectorAll('canvas')) c.style.width = w + 'px';
              return [document.scrollingElement.scrollWidth, window.innerWidth];
            }""",
            DESKTOP["width"] - 200,
        )
        assert widths == [PHONE["width"], PHONE["width"]], widths
        page.close()
    assert _page_errors(console) == []


def test_it_lets_staff_sort_the_cost_report_and_download_csv(live, make_tenant):
    small, _ = make_tenant()
    big, _ = make_tenant()
    _history(small, days=2)
    _history(big, days=6)
    User.objects.create_user("root", password="root", is_staff=True)
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "root", "root")  # staff without a team: lands on "no team"
        console.errors.clear()
        page.goto("/billing/staff/costs/")
        expect(page.get_by_role("heading", name="Cost report")).to_be_visible()
        expect(page.locator("#price-book")).to_have_text("hedgerow v1")
        rows = page.locator("#cost-table tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.first).to_have_attribute("data-tenant", big.slug)  # default: -cost
        page.locator('th a[data-sort="cost"]').click()  # descending already → ascending
        expect(rows.first).to_have_attribute("data-tenant", small.slug)
        expect(page.locator('th[aria-sort="ascending"]')).to_contain_text("cost")
        with page.expect_download() as download:
            page.locator("#csv-link").click()
        content = open(download.value.path()).read()  # noqa: SIM115 - tiny file
        screenshot(page, "billing-cost-report")
        page.close()
    lines = content.splitlines()
    assert lines[0].startswith("tenant,sandboxes,sandbox_hours")
    assert [line.split(",")[0] for line in lines[1:]] == [small.slug, big.slug]
    assert _page_errors(console) == []
