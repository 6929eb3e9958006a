"""The Images page in real Chromium against the live stack: a pull from the page runs
in the worker and its row turns ready without a reload; pull progress is drawn from the
team's ``image.progress`` events; delete asks first. No sideways scrolling at either
screen size, no console errors."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from apps.images.models import Image, ImageStatus
from apps.images.services import publish_image
from apps.images.tests.conftest import push_image
from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    screenshot,
    sideways_overflow,
    sign_in,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def _off_the_loop(fn: Callable[[], Any]) -> None:
    """Runs ``fn`` in a thread: Playwright's loop runs in this one, and Django refuses
    ORM calls under a running loop."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised below
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and not failed, failed


def test_it_pulls_from_the_page_and_the_row_turns_ready_without_reloading(
    live: Any, make_tenant: Any, make_user: Any, open_registry: Any, tmp_path: Path
) -> None:
    tenant, _ = make_tenant()
    make_user("ivy", (tenant, "member"))
    ref, digest = push_image(open_registry, tmp_path, f"t{uuid.uuid4().hex[:10]}/page")
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "ivy", "ivy")
        page.get_by_role("navigation", name="Main").get_by_role("link", name="Images").click()
        expect(page.locator("#images-table")).to_contain_text("No images yet")
        page.get_by_label("Reference").fill(ref)
        page.get_by_role("button", name="Pull", exact=True).click()
        expect(page.locator(".flash")).to_contain_text(f"Pulling {ref}.")
        page.evaluate("window.__sameDocument = true")
        row = page.locator("#images-table tr[data-image-id]")
        expect(row).to_have_count(1)
        expect(row.locator("[data-image-status]")).to_have_text("ready", timeout=120_000)
        expect(row.locator(f'span[title="{digest}"]')).to_have_count(1)
        assert page.evaluate("window.__sameDocument") is True, "the page reloaded"
        assert sideways_overflow(page) == []
        assert axe_violations(page) == []
        screenshot(page, "images")

        row.get_by_role("button", name=f"Delete {ref}").click()
        dialog = page.locator("#confirm-dialog")
        expect(dialog).to_contain_text(f"Delete image {ref}?")
        dialog.get_by_role("button", name="Yes, do it").click()
        expect(page.locator(".flash")).to_contain_text(f"Deleted {ref}.")
        expect(page.locator("#images-table")).to_contain_text("No images yet")
    assert console.errors == []
    assert not Image.objects.filter(tenant=tenant).exists()


def test_it_draws_pull_progress_from_image_progress_events(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    make_user("jon", (tenant, "viewer"))
    image = Image.objects.create(
        tenant=tenant, reference="registry.example/acme/big:1", progress={"phase": "queued"}
    )
    tenant_id, image_id = str(tenant.pk), str(image.pk)
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "jon", "jon")
        page.goto("/images/")
        row = page.locator(f'tr[data-image-id="{image_id}"]')
        expect(row.locator("[data-image-status]")).to_have_text("pulling")
        expect(page.locator("[data-images-page]")).to_have_attribute("data-subscribed", "yes")

        mib = 1024 * 1024
        progress = {"phase": "fetching", "layers": 2, "bytes": 3 * mib, "total": 4 * mib}
        publish_image(tenant_id, image_id, image.reference, "pulling", progress)
        expect(row.locator("[data-progress-text]")).to_have_text(
            "fetching · 3.0 MiB of 4.0 MiB · 2 layers"
        )
        expect(row.locator(".meter-fill")).to_have_attribute("style", "width: 75%;")
        assert axe_violations(page) == []

        def finish() -> None:
            Image.objects.filter(pk=image_id).update(
                status=ImageStatus.READY, size_bytes=4 * 1024 * 1024, layers=2, progress=None
            )

        _off_the_loop(finish)
        publish_image(tenant_id, image_id, image.reference, "ready", None)
        expect(row.locator("[data-image-status]")).to_have_text("ready")
        expect(row).to_contain_text("4.0 MiB")
        expect(row.locator("[data-progress]")).to_have_count(0)
    assert console.errors == []


def test_focus_stays_on_its_control_when_the_table_is_re_read(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    """Issue 24, defect 12: a live re-read swapped the focused button away and focus
    fell to <body>; the same control in the new table gets it back."""
    tenant, _ = make_tenant()
    make_user("kai", (tenant, "member"))
    ref = "registry.example/acme/focus:1"
    Image.objects.create(tenant=tenant, reference=ref, status=ImageStatus.READY)
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "kai", "kai")
        page.goto("/images/")
        button = page.get_by_role("button", name=f"Delete {ref}")
        button.focus()
        page.evaluate("window.__swapped = false")
        page.evaluate(
            "document.body.addEventListener('htmx:afterSettle', () => { window.__swapped = true },"
            " { once: true }); window.htmx.trigger('#images-table', 'refresh')"
        )
        page.wait_for_function("window.__swapped === true")
        expect(button).to_be_focused()
        assert page.evaluate("document.activeElement.getAttribute('aria-label')") == (
            f"Delete {ref}"
        )
    assert console.errors == []
