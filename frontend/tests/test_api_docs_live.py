"""Issue 24, defect 5: the API docs page works with no way out of the machine. Every
request that would leave loopback is refused by the browser itself (a route that aborts
it and remembers it), and Swagger UI must still render the API's operations from the
project's own pinned static files (drf-spectacular-sidecar)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Route, expect

from frontend.tests.browser import Console, chromium, new_page

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("assets")]

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def test_the_api_docs_render_every_operation_with_no_outside_network(live):
    console = Console()
    outside: list[str] = []

    def only_loopback(route: Route) -> None:
        if urlsplit(route.request.url).hostname in LOOPBACK:
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort("internetdisconnected")

    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.route("**/*", only_loopback)
        response = page.goto("/api/docs/")
        assert response is not None and response.status == 200
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("Hedgerow API")
        operations = page.locator(".swagger-ui .opblock")
        expect(operations.first).to_be_visible()
        expect(
            page.locator(".opblock-summary-path", has_text="/api/v1/sandboxes").first
        ).to_be_visible()
        expect(
            page.locator(".opblock-summary-path", has_text="/api/v1/activity").first
        ).to_be_visible()
        count = operations.count()
        # open one operation: its parameters come from the same local schema
        page.locator(".opblock-summary-path", has_text="/api/v1/activity").first.click()
        expect(page.locator(".opblock.is-open .parameters-container")).to_contain_text("cursor")
        assets = page.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
    assert count > 40, count
    assert outside == [], outside
    assert all(urlsplit(url).hostname in LOOPBACK for url in assets), assets
    assert any(url.endswith("swagger-ui-bundle.js") for url in assets), assets
    assert console.errors == []
