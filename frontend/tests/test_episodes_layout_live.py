"""Issue 24, defect 4: the Episodes table fits a 1440 px screen (it was 2082 px inside
1230, hiding Reward, Cost and Started), and no page scrolls sideways on a phone."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.trajectories.models import Episode
from frontend.tests.browser import (
    DESKTOP,
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def test_the_episodes_table_fits_a_laptop_and_the_page_fits_a_phone(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    make_user("ula", (tenant, "member"))
    now = timezone.now()
    for i, cls in enumerate(("success", "task", "environment", "verifier")):
        Episode.objects.create(
            tenant=tenant,
            task_id=f"swe-bench/django__django-1{i}234-long-task-identifier",
            task_version="2026-11-30",
            model="anthropic/claude-sonnet-4-5-20250929-preview",
            harness="mini-swe-agent-harness",
            policy_version=f"ppo-run-17/checkpoint-{i}000",
            status="closed",
            started_at=now,
            ended_at=now,
            auto_failure_class=cls,
            failure_class=cls,
            termination_reason="verifier",
            reward=0.75,
            cost=Decimal("0.123456"),
        )
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "ula", "ula")
        page.set_viewport_size(DESKTOP)
        page.goto("/trajectories/")
        expect(page.locator("#episodes tbody tr")).to_have_count(4)
        widths = page.evaluate(
            "(() => { const t = document.querySelector('#episodes');"
            " return [t.scrollWidth, t.parentElement.clientWidth]; })()"
        )
        assert widths[0] <= widths[1], f"episodes table {widths[0]} px in a {widths[1]} px box"
        # below the filters, numbers and per-task table: scrolled to (vertically only,
        # since the table fits its box), the last column is on screen, not clipped
        page.locator("#episodes").scroll_into_view_if_needed()
        started = page.locator("#episodes thead th", has_text="Started")
        expect(started).to_be_in_viewport()
        assert sideways_overflow(page) == []
        assert axe_violations(page) == []
    assert console.errors == []
