"""Per-sandbox metrics on the sandbox page (issue 24): the page polls
/api/v1/sandboxes/<id>/metrics and draws CPU, memory and pids charts, with the latest
values beside them; reopened, it starts from the history the server kept. Real sandbox,
real Chromium, axe."""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from apps.sandboxes.tests.test_metrics_live import HOLD
from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    screenshot,
    sideways_overflow,
    sign_in,
)
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("assets")]

MIB = 1 << 20
# some pixel of the canvas is painted (Chart.js drew into it)
PAINTED = """(c) => {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  for (let i = 3; i < d.length; i += 4) if (d[i] > 0) return true;
  return false;
}"""


def test_the_sandbox_page_charts_its_metrics(live: Any, make_tenant: Any, make_user: Any) -> None:
    tenant, secret = make_tenant()
    make_user("yarrow", (tenant, "viewer"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http, memory="512Mi")
    held = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": HOLD})
    assert held.status_code == 200 and held.json()["stdout"] == "held", held.text

    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "yarrow", "yarrow")
        page.goto(f"/sandboxes/{sandbox_id}/")
        panel = page.locator("#metrics")
        expect(panel.get_by_role("heading", name="Metrics")).to_be_visible()
        # two samples (one poll interval apart): the CPU rate needs both
        expect(panel).to_have_attribute("data-samples", re.compile(r"^([2-9]|\d\d+)$"))
        expect(panel.locator("[data-metrics-status]")).to_contain_text("since this page opened")

        memory = panel.locator('[data-metric-value="memory"]')
        assert int(memory.get_attribute("data-value") or 0) >= 96 * MIB
        expect(memory).to_contain_text("of 512")
        assert (
            int(panel.locator('[data-metric-value="pids"]').get_attribute("data-value") or 0) >= 2
        )
        assert (
            float(panel.locator('[data-metric-value="cpu"]').get_attribute("data-value") or -1) >= 0
        )

        for metric in ("cpu", "memory", "pids"):
            canvas = panel.locator(f'canvas[data-metric="{metric}"]')
            expect(canvas).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
            assert canvas.evaluate(PAINTED), f"the {metric} chart drew nothing"

        panel.scroll_into_view_if_needed()
        screenshot(page, "sandbox-metrics")
        assert axe_violations(page) == []
        assert sideways_overflow(page) == []

        # reopened: the server kept what the first visit sampled, so the charts start
        # with it instead of from nothing
        drawn = int(panel.get_attribute("data-samples") or 0)
        page.reload()
        expect(panel.locator("[data-metrics-status]")).to_contain_text(
            "kept by the server from before this page opened"
        )
        assert int(panel.get_attribute("data-samples") or 0) >= 2
        assert int(panel.get_attribute("data-samples") or 0) >= min(drawn, 2)
        for metric in ("memory", "pids"):
            canvas = panel.locator(f'canvas[data-metric="{metric}"]')
            expect(canvas).to_have_attribute("data-points", re.compile(r"^([2-9]|\d\d+)$"))
        page.close()
    assert console.errors == []
