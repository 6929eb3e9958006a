"""A command run by the SDK/API has readable output on the sandbox page (issue 24,
defect 8): its row opens to the stored stdout/stderr and downloads them, in Chromium."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.sandboxes.models import Operation, OperationStatus, Sandbox
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
    # twenty commands before it (an SDK loop): the page lists the newest 20 and offers
    # the rest with "Show older commands"
    sandbox = Sandbox.objects.get(external_id=sandbox_id)
    earlier = timezone.now() - timedelta(hours=1)
    for i in range(20):
        Operation.objects.create(
            tenant=tenant,
            sandbox=sandbox,
            operation_id=f"op-old-{i:02d}",
            generation=sandbox.generation,
            request={"command": f"echo {i}"},
            request_hash=f"h{i}",
            status=OperationStatus.COMPLETED,
            termination="exited",
            exit_code=0,
            stdout={"head": f"{i}\n", "tail": "", "truncated": False, "total_bytes": 2},
            stderr={},
            created_at=earlier + timedelta(seconds=i),
        )
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

        rows = page.locator("#operations tr[data-operation-id]")
        expect(rows).to_have_count(20)
        expect(page.get_by_role("button", name="Output of op-old-00")).to_have_count(0)
        page.get_by_role("button", name="Show older commands").click()
        expect(rows).to_have_count(1)  # the next cursor page: the one older command
        expect(page.get_by_role("button", name="Show older commands")).to_have_count(0)
        oldest = page.get_by_role("button", name="Output of op-old-00")
        oldest.click()
        expect(page.locator('[data-op-output="op-old-00"] [data-stream="stdout"]')).to_have_text(
            "0\n"
        )
    assert console.errors == []
