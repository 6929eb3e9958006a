"""Keys (rename, rotate with a grace, last use and its address) and the team Activity
page in real Chromium, with axe-core and no sideways scrolling at 1440×900 and 390×844.

Rows are set up before the browser opens and checked after it closes (Playwright's sync
API runs an event loop, under which Django refuses ORM calls)."""

from __future__ import annotations

import csv
import io

import httpx
import pytest
from playwright.sync_api import Page, expect

from apps.tenancy.models import Activity, ApiKey
from apps.tenancy.secrets import hash_secret
from apps.tenancy.services import api_key_create
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


def _checked_at_both_sizes(page: Page) -> list[str]:
    return sideways_overflow(page) + axe_violations(page)  # each at 1440×900 and 390×844


def _api(url: str, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
        trust_env=False,
    )


def test_rename_rotate_last_use_and_the_activity_log_in_a_browser(live, make_tenant, make_user):
    tenant, _ = make_tenant(slug="rl-lab")
    maya = make_user("maya", (tenant, "owner"))
    make_user("noor", (tenant, "member"))
    issued = api_key_create(tenant=tenant, name="ci", scopes=["read"], created_by=maya)
    old_secret = issued.secret
    with _api(live.url, old_secret) as http:
        assert http.get("/sandboxes").status_code == 200  # a last use, from loopback

    console = Console()
    problems: dict[str, list[str]] = {}
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "maya", "maya")
        page.goto("/keys/")
        row = page.locator(f'#keys-table tr[data-key-prefix="{issued.key.prefix}"]')
        expect(row).to_contain_text("127.0.0.1")  # last used from
        row.locator("summary").click()
        row.get_by_label("Change ci to").fill("ci-nightly")
        row.get_by_role("button", name="Rename").click()
        expect(page.locator(".flash")).to_contain_text("Renamed ci to ci-nightly")
        expect(row.locator("strong").first).to_have_text("ci-nightly")

        row.locator("summary").click()
        row.get_by_label("Old secret of ci-nightly keeps working for").select_option("3600")
        row.get_by_role("button", name="Rotate").click()
        page.locator("#confirm-dialog").get_by_role("button", name="Yes, do it").click()
        expect(page.locator("#new-key-secret")).to_be_visible()
        expect(page.locator("#new-key")).to_contain_text("new secret of ci-nightly")
        expect(page.locator("#grace-end")).to_be_visible()
        new_secret = page.locator("#new-key-secret").inner_text().strip()
        assert new_secret.startswith("hr_") and new_secret != old_secret
        assert new_secret not in page.url
        problems["/keys/ (secret shown)"] = _checked_at_both_sizes(page)
        page.reload()  # post/redirect/get: the secret is not shown again
        expect(page.locator("#keys-table")).to_be_visible()
        expect(page.locator("#new-key-secret")).to_have_count(0)

        # both secrets work during the grace
        for secret in (old_secret, new_secret):
            with _api(live.url, secret) as http:
                assert http.get("/sandboxes").status_code == 200

        page.goto("/activity/")
        expect(page.locator('nav a[aria-current="page"]')).to_have_text("Activity")
        rows = page.locator("#activity-table tbody tr")
        expect(rows.first).to_have_attribute("data-action", "key.rotated")
        expect(rows.first).to_contain_text("user:maya")
        expect(page.locator('#activity-table tr[data-action="key.renamed"]')).to_contain_text(
            "old_name: ci"
        )
        screenshot(page, "activity")
        page.get_by_label("Action").select_option("key.renamed")
        page.get_by_role("button", name="Filter").click()
        expect(rows).to_have_count(1)
        expect(page).to_have_url(f"{live.url}/activity/?action=key.renamed")
        problems["/activity/"] = _checked_at_both_sizes(page)
        page.goto("/activity/")
        with page.expect_download() as download:
            page.locator("#export-csv").click()
        exported = open(download.value.path()).read()  # noqa: SIM115 - tiny file

        # a member may not read the log (the server refuses, not just the menu)
        # (its own console: the refused page's 403 is logged there, as it should be)
        member = new_page(browser, live.url, Console())
        sign_in(member, "noor", "noor")
        expect(member.locator("nav").get_by_role("link", name="Activity")).to_have_count(0)
        forbidden = member.goto("/activity/")
        assert forbidden is not None and forbidden.status == 403
        refused = member.request.get(f"{live.url}/api/v1/activity")
        assert refused.status == 403

    assert {path: found for path, found in problems.items() if found} == {}
    assert console.errors == []
    table = list(csv.DictReader(io.StringIO(exported)))
    assert [r["action"] for r in table][:3] == ["key.rotated", "key.renamed", "key.created"]
    assert old_secret not in exported and new_secret not in exported
    key = ApiKey.objects.get(pk=issued.key.pk)
    assert key.name == "ci-nightly" and key.secret_hash == hash_secret(new_secret)
    assert key.previous_secret_hash == hash_secret(old_secret)
    assert key.last_used_from == "127.0.0.1"
    assert (
        Activity.objects.filter(tenant=tenant, action="key.rotated", actor="user:maya").count() == 1
    )
