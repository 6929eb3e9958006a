"""Issue 24's "as the other issues land" pages, in real Chromium with axe-core and no
sideways scrolling at 1440×900 and 390×844: an episode's per-test verifier vector
(issue 22) and an imported episode's claimed class next to the class this
installation's ledger attributed (the Trajectories list marks it, the episode page says
both). Their HTML is checked by ``test_pages_vector.py`` and
``test_attribution_ledger.py``; this is the browser's view of the same rows.

Rows are set up before the browser opens (Playwright's sync API runs an event loop,
under which Django refuses ORM calls)."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect
from rest_framework.test import APIClient

from apps.trajectories.models import Episode
from apps.trajectories.tests.test_pages_vector import JUNIT, _episode_with_verifier
from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def _checked_at_both_sizes(page: Page) -> list[str]:
    return sideways_overflow(page) + axe_violations(page)


def test_the_vector_and_the_claimed_class_in_a_browser(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, secret = make_tenant()
    make_user("vic", (tenant, "member"))
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    vector = _episode_with_verifier(api, "vec", JUNIT)
    now = timezone.now()
    Episode.objects.create(
        tenant=tenant,
        episode_id="ep-imported",
        task_id="imported-task",
        status="closed",
        started_at=now,
        ended_at=now,
        auto_failure_class="environment",
        failure_class="environment",
        claimed_class="success",
        failure_evidence=[
            {"class": "environment", "rule": "infra_fault_during_episode", "decisive": True},
            {"source": "import", "detail": "the import claimed success"},
        ],
    )

    console = Console()
    problems: dict[str, list[str]] = {}
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "vic", "vic")
        page.goto(f"/trajectories/{vector}/")
        results = page.locator('.verifier-results[data-step="0"]')
        expect(results).to_contain_text("1 passed · 1 failed · 0 error · 1 skipped")
        expect(results.locator("tr[data-result]")).to_have_count(3)
        expect(results.locator('tr[data-result="failed"]')).to_contain_text("test_bad")
        problems["episode (vector)"] = _checked_at_both_sizes(page)

        page.goto("/trajectories/")
        marked = page.locator('[data-claimed="success"]')
        expect(marked).to_have_text("claimed success")
        problems["trajectories (claimed)"] = _checked_at_both_sizes(page)

        page.goto("/trajectories/ep-imported/")
        claim = page.locator("#claim")
        expect(claim).to_contain_text("claimed success")
        expect(claim).to_contain_text("this installation's ledger says environment")
        expect(page.locator("#evidence")).to_contain_text("infra_fault_during_episode")
        problems["episode (claimed)"] = _checked_at_both_sizes(page)

    assert {path: found for path, found in problems.items() if found} == {}
    assert console.errors == []
