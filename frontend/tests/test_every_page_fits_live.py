"""Issue 24, defect 4: every dashboard page fits a 1440x900 laptop and a 390x844 phone.

The rule (docs/frontend.md, "Wide tables"): the document never scrolls sideways; a
table wider than its box scrolls inside its own ``.table-wrap`` only, and then its key
column (the first; for selectable sandbox rows the checkbox and the id) stays in view
however far the box is scrolled. At 1440 px the Episodes and per-task tables need no
scrolling at all. Pages are seeded with long task ids, model names and labels, a real
sandbox with its terminal open, and episodes to compare; staff pages are included.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Page, expect

from apps.trajectories.models import Episode
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
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(420), pytest.mark.usefixtures("assets")]

# For every .table-wrap that scrolls: scroll it to its far right and report the key
# column's header if it left the box (the box is then scrolled back).
_KEY_COLUMNS_HIDDEN = """() => {
  const hidden = [];
  for (const wrap of document.querySelectorAll('.table-wrap')) {
    const table = wrap.querySelector(':scope > table');
    if (!table || wrap.scrollWidth <= wrap.clientWidth + 1 || !wrap.offsetParent) continue;
    const selectable = table.classList.contains('selectable');
    const head = table.querySelector('tr');
    const keys = [...head.children].slice(0, selectable ? 2 : 1);
    const before = wrap.scrollLeft;
    wrap.scrollLeft = wrap.scrollWidth;
    const box = wrap.getBoundingClientRect();
    for (const cell of keys) {
      const r = cell.getBoundingClientRect();
      if (r.left < box.left - 1 || r.right > box.right + 1) {
        hidden.push((table.id || wrap.id || table.className || 'table') + ': ' +
                    (cell.textContent.trim() || cell.innerHTML.slice(0, 40)));
      }
    }
    wrap.scrollLeft = before;
  }
  return hidden;
}"""


def _check(page: Page) -> list[str]:
    found = sideways_overflow(page)
    for size in (DESKTOP, PHONE):
        page.set_viewport_size(size)
        page.wait_for_function(
            "(w) => window.innerWidth === w && "
            "document.scrollingElement.scrollWidth <= window.innerWidth",
            arg=size["width"],
        )
        found += [
            f"{size['width']}px key column hidden: {h}" for h in page.evaluate(_KEY_COLUMNS_HIDDEN)
        ]
    page.set_viewport_size(DESKTOP)
    return found + axe_violations(page)


def test_every_page_fits_a_laptop_and_a_phone(live: Any, make_tenant: Any, make_user: Any) -> None:
    tenant, secret = make_tenant()
    staff = make_user("pia", (tenant, "owner"))
    User.objects.filter(pk=staff.pk).update(is_staff=True)
    now = timezone.now()
    episodes = []
    for i in range(12):
        episodes.append(
            Episode.objects.create(
                tenant=tenant,
                task_id=f"swe-bench-verified/astropy__astropy-{13000 + i % 4}-a-long-task-name",
                task_version="2026-11-30",
                model="anthropic/claude-sonnet-4-5-20250929-extended-preview",
                harness="mini-swe-agent-harness-with-a-long-name",
                policy_version=f"ppo-run-17/checkpoint-{i}000-long-suffix",
                status="closed",
                started_at=now - timedelta(minutes=i),
                ended_at=now,
                auto_failure_class=("success", "task", "environment", "verifier")[i % 4],
                failure_class=("success", "task", "environment", "verifier")[i % 4],
                termination_reason="verifier",
                reward=0.5,
                cost=Decimal("0.123456"),
                labels={"experiment": "a-rather-long-experiment-label-value", "seed": str(i)},
            )
        )
    http = _api(live, secret)
    sandbox_id = _create_ready(
        http, labels={"experiment": "a-rather-long-experiment-label-value", "task": "x" * 40}
    )
    for command in ("ls -la /workspace", "echo " + "long-output-" * 30):
        assert http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": command}).is_success
    first, second = episodes[0].episode_id, episodes[4].episode_id

    console = Console()
    problems: dict[str, list[str]] = {}
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.set_viewport_size(DESKTOP)
        # the sign-in page, signed out
        page.goto("/login/")
        problems["/login/"] = _check(page)
        sign_in(page, "pia", "pia")

        # the sandbox page with its terminal open: the terminal fits the phone too
        page.goto(f"/sandboxes/{sandbox_id}/")
        page.get_by_role("button", name="Open terminal").click()
        expect(page.locator("#terminal-status")).to_contain_text("connected")
        problems["sandbox detail + terminal"] = _check(page)
        page.set_viewport_size(PHONE)
        box = page.locator("#terminal").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
        page.set_viewport_size(DESKTOP)

        # at 1440 px the per-task table shows every column, no scrolling needed
        page.goto("/trajectories/")
        widths = page.evaluate(
            "['#per-task', '#episodes'].map(s => { const t = document.querySelector(s);"
            " return [s, t.scrollWidth, t.parentElement.clientWidth]; })"
        )
        for selector, width, box_width in widths:
            assert width <= box_width, f"{selector}: {width} px in a {box_width} px box"
        expect(page.locator("#per-task thead th", has_text="Success (valid)")).to_be_in_viewport()

        for path in (
            "/sandboxes/?state=all",
            "/trajectories/",
            f"/trajectories/{first}/",
            f"/trajectories/compare?a={first}&b={second}",
            "/datasets/",
            "/datasets/matrix",
            "/keys/",
            "/members/",
            "/billing/usage/",
            "/images/",
            "/reports/leaks/mine",
            "/billing/staff/costs/",
            "/reports/leaks",
        ):
            response = page.goto(path)
            assert response is not None and response.status == 200, path
            page.wait_for_load_state("networkidle")
            problems[path] = _check(page)
        response = page.goto("/no-such-page/")
        assert response is not None and response.status == 404
        problems["404"] = _check(page)
    assert {path: found for path, found in problems.items() if found} == {}
    # the one expected error: Chromium logs the 404 page's own status
    assert [e for e in console.errors if "/no-such-page/" not in e] == []
