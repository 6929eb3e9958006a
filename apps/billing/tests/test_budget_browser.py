"""The team's own budget, alert and webhook on the Usage page, the budget notice banner
on the Sandboxes page, and a create refused at the budget (issue 24, "budget and alert
thresholds editable by owners" and their notifications), in real Chromium with axe-core
and no sideways scrolling at 1440×900 and 390×844.

Rows are set up before a browser opens and checked after it closes (Playwright's sync
API runs an event loop, under which Django refuses ORM calls): the notice check runs
between two browser sessions, as the beat task would between two visits."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.billing import notices
from apps.billing.models import BudgetNotice
from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import ledger_sandbox
from apps.sandboxes.models import Sandbox
from apps.tenancy.models import Action, Activity
from apps.tenancy.services import membership_set_role
from frontend.tests.browser import (
    ROOT,
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
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


def make_user(username: str, *memberships: tuple[Any, str]) -> User:
    """A user with a role in each given team; the password is the username."""
    user = User.objects.create_user(username=username, password=username)
    for tenant, role in memberships:
        membership_set_role(tenant=tenant, user=user, role=role)
    return user


def _checked_at_both_sizes(page: Page) -> list[str]:
    return sideways_overflow(page) + axe_violations(page)


def test_owners_set_the_budget_and_a_member_meets_the_banner_and_the_refusal(
    live: Any, make_tenant: Any
) -> None:
    tenant, _ = make_tenant(slug="budget-lab")
    make_user("bea", (tenant, "owner"))
    make_user("milo", (tenant, "member"))
    # 8 vCPU for 4 h this month at the seeded $0.04/vCPU-h: $1.28 spent
    ledger_sandbox(
        tenant,
        timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0),
        [("provisioning", 0), ("ready", 10), ("deleted", 4 * 3600)],
        cpu_millis=8000,
        memory_mib=32,
    )
    sandboxes_before = Sandbox.objects.filter(tenant=tenant).count()

    console = Console()
    problems: dict[str, list[str]] = {}
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "bea", "bea")
        page.goto("/billing/usage/")
        expect(page.locator("#team-budget")).to_contain_text("no budget of its own")
        page.get_by_label("Team budget (USD a month, a hard limit; empty for none)").fill("1.5x")
        page.get_by_role("button", name="Save budget").click()
        expect(page.locator("#e-team-budget")).to_contain_text("Enter an amount in dollars")
        problems["/billing/usage/ (refused amount)"] = _checked_at_both_sizes(page)
        page.get_by_label("Team budget (USD a month, a hard limit; empty for none)").fill("$1")
        page.get_by_role("button", name="Save budget").click()
        expect(page.locator(".flash").first).to_contain_text("Team budget set at $1.00 a month.")
        expect(page.locator("#team-budget-reached")).to_contain_text("new sandboxes are refused")
        page.get_by_label("Webhook URL (replaces the one set; empty removes it)").fill(
            "https://hooks.example/t/very-secret"
        )
        page.get_by_role("button", name="Save webhook").click()
        expect(page.locator("#webhook-state")).to_have_text(
            "A webhook is set: crossed alerts and budgets are POSTed to it."
        )
        assert "very-secret" not in page.content()
        problems["/billing/usage/"] = _checked_at_both_sizes(page)

        member = new_page(browser, live.url, Console())
        sign_in(member, "milo", "milo")
        member.goto("/billing/usage/")
        expect(member.locator("#team-budget-reached")).to_be_visible()
        expect(member.get_by_role("button", name="Save budget")).to_have_count(0)

    assert quota_get(tenant=tenant).team_budget == Decimal("1.00")
    (notice_id,) = notices.notices_check(tenant=tenant)  # the webhook is set: one to deliver
    assert BudgetNotice.objects.get(pk=notice_id).kind == "team_budget"

    console = Console()
    with chromium() as browser:
        member = new_page(browser, live.url, console)
        sign_in(member, "milo", "milo")
        member.goto("/sandboxes/")
        banner = member.locator("#budget-notices")
        expect(banner).to_contain_text("has reached the monthly budget the team's owners set")
        expect(banner).to_contain_text("New sandboxes are refused")
        problems["/sandboxes/ (banner)"] = _checked_at_both_sizes(member)
        member.locator("#create-form").get_by_role("button", name="Create sandbox").click()
        expect(member.locator("#create-form .form-error")).to_contain_text("its owners set")

    assert {path: found for path, found in problems.items() if found} == {}
    assert console.errors == []
    assert Sandbox.objects.filter(tenant=tenant).count() == sandboxes_before  # none created
    crossed = Activity.objects.get(tenant=tenant, action=Action.BUDGET_CROSSED)
    assert crossed.details["kind"] == "team_budget" and crossed.details["threshold"] == "1.00"
    changed = Activity.objects.filter(tenant=tenant, action=Action.QUOTA_CHANGED)
    assert "very-secret" not in str([c.details for c in changed])
    assert timezone.now() - crossed.at < timedelta(minutes=5)
