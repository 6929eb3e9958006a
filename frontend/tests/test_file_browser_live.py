"""The file browser keeps its place (issue 24, defect 6): the directory is in the URL,
an upload lands in and re-lists the directory shown, replacing a file asks first, and
files and directories can be deleted after a confirmation. Real Chromium, real sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from frontend.tests.browser import Console, axe_violations, chromium, new_page, sign_in
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def test_it_keeps_its_place_asks_before_replacing_and_deletes(
    live: Any, make_tenant: Any, make_user: Any, tmp_path: Path
) -> None:
    tenant, secret = make_tenant()
    make_user("fern", (tenant, "member"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http)
    seeded = http.put(
        f"/sandboxes/{sandbox_id}/files", params={"path": "/workspace/data/seed.txt"}, content=b"v1"
    )
    assert seeded.status_code == 200, seeded.text
    local = tmp_path / "seed.txt"
    local.write_bytes(b"v2-from-browser")
    other = tmp_path / "notes.txt"
    other.write_bytes(b"notes")
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "fern", "fern")
        page.goto(f"/sandboxes/{sandbox_id}/")
        page.locator('#files tr[data-entry="data"]').get_by_role("link").click()
        expect(page.locator("#files [data-files-path]")).to_have_attribute(
            "data-files-path", "/workspace/data"
        )
        expect(page).to_have_url(f"{live.url}/sandboxes/{sandbox_id}/?path=%2Fworkspace%2Fdata")

        # an upload lands in the directory shown and the listing stays there
        page.set_input_files("#upload-file", str(other))
        page.get_by_role("button", name="Upload here").click()
        message = page.locator(".upload-message")
        expect(message).to_contain_text("Uploaded /workspace/data/notes.txt")
        expect(page.locator('#files tr[data-entry="notes.txt"]')).to_have_count(1)
        expect(page.locator("#files [data-files-path]")).to_have_attribute(
            "data-files-path", "/workspace/data"
        )

        # the same name asks first: cancel keeps the file, confirm replaces it
        dialog = page.locator("#confirm-dialog")
        page.set_input_files("#upload-file", str(local))
        page.get_by_role("button", name="Upload here").click()
        expect(dialog).to_contain_text("Replace /workspace/data/seed.txt?")
        dialog.get_by_role("button", name="Cancel").click()
        expect(page.locator(".upload-message")).to_have_text("Upload cancelled.")
        page.get_by_role("button", name="Upload here").click()
        dialog.get_by_role("button", name="Yes, do it").click()
        expect(page.locator(".upload-message")).to_contain_text("Uploaded /workspace/data/seed.txt")

        # a reload opens where the URL says
        page.reload()
        expect(page.locator('#files tr[data-entry="seed.txt"]')).to_contain_text("15 B")
        assert axe_violations(page) == []

        page.get_by_role("button", name="Delete notes.txt").click()
        expect(dialog).to_contain_text("Delete /workspace/data/notes.txt?")
        dialog.get_by_role("button", name="Yes, do it").click()
        deleted = page.locator("#files .files-message")
        expect(deleted).to_have_text("Deleted /workspace/data/notes.txt.")
        expect(page.locator('#files tr[data-entry="notes.txt"]')).to_have_count(0)
        expect(page.locator("#files [data-files-path]")).to_have_attribute(
            "data-files-path", "/workspace/data"
        )

        page.get_by_label("New folder name").fill("runs")
        page.get_by_role("button", name="New folder").click()
        expect(page.locator("#files .files-message")).to_have_text("Created /workspace/data/runs/.")
        expect(page.locator('#files tr[data-entry="runs"]')).to_have_count(1)
        expect(page.locator("#files [data-files-path]")).to_have_attribute(
            "data-files-path", "/workspace/data"
        )

        page.locator("#files .breadcrumbs").get_by_role("link", name="workspace").click()
        page.get_by_role("button", name="Delete data").click()
        expect(dialog).to_contain_text("Delete the directory /workspace/data and everything in it?")
        dialog.get_by_role("button", name="Yes, do it").click()
        expect(page.locator('#files tr[data-entry="data"]')).to_have_count(0)
        expect(page).to_have_url(f"{live.url}/sandboxes/{sandbox_id}/?path=%2Fworkspace")
    assert console.errors == []
    gone = http.get(f"/sandboxes/{sandbox_id}/files/stat", params={"path": "/workspace/data"})
    assert gone.status_code == 404, gone.text
