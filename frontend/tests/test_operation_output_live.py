"""A command run by the SDK/API has readable output on the sandbox page (issue 24,
defect 8): its row opens to the stored stdout/stderr and downloads them, in Chromium."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def test_it_opens_an_sdk_commands_stored_output_and_downloads_it(
    live: Any, make_tenant: Any, make_user: Any, tmp_path: Path
) -> None:
    tenant, secret = make_tenant()
    make_user("olga", (tenant, "member"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http)
    ran = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": "seq 1 3000; echo 'went <wrong>' >&2; exit 2", "operation_id": "op-sdk"},
    )
    assert ran.status_code == 200, ran.text
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "olga", "olga")
        page.goto(f"/sandboxes/{sandbox_id}/")
        button = page.get_by_role("button", name="Output of op-sdk")
        expect(button).to_have_attribute("aria-expanded", "false")
        button.click()
        expect(button).to_have_attribute("aria-expanded", "true")
        out = page.locator('[data-op-output="op-sdk"]')
        expect(out.locator('[data-stream="stdout"]')).to_contain_text("2999\n3000")
        expect(out).to_contain_text("1000 earlier stdout lines omitted")
        expect(out.locator('[data-stream="stderr"]')).to_have_text("went <wrong>\n")
        assert sideways_overflow(page) == []
        assert axe_violations(page) == []
        with page.expect_download() as info:
            out.get_by_role("link", name="Download output").click()
        saved = tmp_path / "out.txt"
        info.value.save_as(saved)
        expected = "".join(f"{i}\n" for i in range(1, 3001)) + "--- stderr ---\nwent <wrong>\n"
        assert saved.read_text() == expected
        button.click()
        expect(out).to_be_hidden()
        expect(button).to_have_attribute("aria-expanded", "false")
    assert console.errors == []
