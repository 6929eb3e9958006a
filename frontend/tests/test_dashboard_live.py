"""The dashboard in real Chromium against the real stack (web, worker, sandboxes).

Playwright's sync API runs an event loop while a browser is open, and Django refuses ORM
calls under a running loop; so each test sets up rows before opening the browser, talks
HTTP while it is open, and checks the database after closing it.
"""

from __future__ import annotations

import os

import httpx
import pytest
from playwright.sync_api import Page, expect

from apps.sandboxes.models import Sandbox, State
from frontend.tests.browser import Console, chromium, new_page, sign_in

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def _api(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )


def _create_ready(http: httpx.Client, **body) -> str:
    created = http.post("/sandboxes", json={"image": "host", **body})
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["id"]
    waited = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60})
    assert waited.status_code == 200, waited.text
    return str(sandbox_id)


def _stty_sizes(page: Page, count: int) -> list[str]:
    """Waits until `stty size` has printed ``count`` "rows cols" lines; returns them."""
    handle = page.wait_for_function(
        """(n) => {
          const lines = [...document.querySelectorAll('#terminal .xterm-rows > div')]
            .map(d => d.textContent.trim()).filter(t => /^\\d+ \\d+$/.test(t));
          return lines.length >= n ? lines : null;
        }""",
        arg=count,
    )
    return list(handle.json_value())


def _wait_terminal_line(page: Page, text: str) -> None:
    page.wait_for_function(
        "(t) => [...document.querySelectorAll('#terminal .xterm-rows > div')]"
        ".some(d => d.textContent.trim() === t)",
        arg=text,
    )


def test_it_signs_in_creates_a_sandbox_and_shows_it_turn_ready_without_reloading(
    live, make_tenant, make_user
):
    tenant, _ = make_tenant()
    make_user("alice", (tenant, "owner"))
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "alice", "alice")
        expect(page.locator("#sandbox-table")).to_contain_text("No sandboxes yet")
        page.evaluate("window.__sameDocument = true")

        # Validation is the API's: errors appear next to their fields.
        page.locator("#f-memory").fill("16")
        page.locator("#f-labels").fill("not a label")
        page.get_by_role("button", name="Create sandbox").click()
        expect(page.locator("#e-labels")).to_contain_text("key=value")
        page.locator("#f-labels").fill("experiment=swe-bench\nseed=7")
        page.get_by_role("button", name="Create sandbox").click()
        # The first answer already showed both errors: wait for the second form to be
        # swapped in, or the next fill lands in the old one and is overwritten.
        expect(page.locator("#e-labels")).to_have_count(0)
        expect(page.locator("#e-memory")).to_contain_text("at least 32Mi")
        page.locator("#f-memory").fill("512Mi")
        page.get_by_role("button", name="Create sandbox").click()

        row = page.locator("#sandbox-table tr[data-sandbox-id]")
        expect(row).to_have_count(1)
        expect(row.locator("[data-state]")).to_have_text("ready", timeout=90_000)
        expect(row).to_contain_text("experiment=swe-bench")
        assert page.evaluate("window.__sameDocument") is True, "the page reloaded"
        page.locator("#f-memory").fill("1Gi")
        page.locator("#f-labels").fill("experiment=swe-bench\nseed=8")
        page.get_by_role("button", name="Create sandbox").click()
        expect(page.locator("#sandbox-table tr[data-sandbox-id] [data-state]")).to_have_text(
            ["ready", "ready"], timeout=90_000
        )
        # The quota strip was rendered with the page at 0; it follows the table live.
        expect(page.locator('[data-quota="concurrent_sandboxes"]')).to_contain_text("2 /")
    assert console.errors == []
    rows = Sandbox.objects.filter(tenant=tenant).order_by("created_at")
    assert [(s.state, s.memory_mib, s.labels["seed"]) for s in rows] == [
        (State.READY, 512, "7"),
        (State.READY, 1024, "8"),
    ]


def test_it_drives_the_terminal_and_streams_command_output_live(live, make_tenant, make_user):
    tenant, secret = make_tenant()
    make_user("bob", (tenant, "member"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http, labels={"task": "demo"})
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "bob", "bob")
        page.goto(f"/sandboxes/{sandbox_id}/")
        expect(page.locator("#timeline")).to_contain_text("provisioning → ready")

        page.get_by_role("button", name="Open terminal").click()
        expect(page.locator("#terminal-status")).to_contain_text("connected")
        page.locator("#terminal").click()
        page.keyboard.type("echo hi\n")
        _wait_terminal_line(page, "hi")
        page.keyboard.type("sleep 300\n")
        page.keyboard.press("Control+c")
        page.keyboard.type("echo after-interrupt\n")
        _wait_terminal_line(page, "after-interrupt")
        page.keyboard.type("stty size\n")
        before = _stty_sizes(page, 1)[0]
        page.set_viewport_size({"width": 1100, "height": 900})  # the terminal refits
        page.keyboard.type("stty size\n")
        after = _stty_sizes(page, 2)[1]
        assert before.split()[1] != after.split()[1], (before, after)
        page.set_viewport_size({"width": 1280, "height": 800})

        # The command blocks until a file appears, so its first line must be on the
        # page while it still runs; then the file is uploaded and it finishes.
        command = (
            "echo first; echo oops >&2; "
            "while [ ! -f /workspace/go ]; do sleep 0.1; done; echo second; exit 3"
        )
        page.get_by_label("Command", exact=True).fill(command)
        page.get_by_role("button", name="Run", exact=True).click()
        expect(page.locator("#exec-output .stream-stdout")).to_contain_text("first")
        expect(page.locator("#exec-output .stream-stderr")).to_contain_text("oops")
        expect(page.locator("#exec-status")).to_have_text("running…")
        put = http.put(f"/sandboxes/{sandbox_id}/files", params={"path": "/workspace/go"})
        assert put.status_code == 200, put.text
        expect(page.locator("#exec-output")).to_contain_text("second")
        expect(page.locator("#exec-status")).to_contain_text("exit code 3")
        expect(page.locator("#operations")).to_contain_text("exit 3")

        page.locator("#terminal").click()
        page.keyboard.type("exit\n")
        expect(page.locator("#terminal-status")).to_contain_text("exited with code 0")
    assert console.errors == []
    ops = list(Sandbox.objects.get(tenant=tenant).operations.values_list("exit_code", "status"))
    assert ops == [(3, "completed")]


def test_it_uploads_a_file_downloads_it_identically_and_deletes_after_confirming(
    live, make_tenant, make_user, tmp_path
):
    tenant, secret = make_tenant()
    make_user("carol", (tenant, "admin"))
    sandbox_id = _create_ready(_api(live, secret))
    payload = os.urandom(300_000) + bytes(range(256))
    source = tmp_path / "weights.bin"
    source.write_bytes(payload)
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "carol", "carol")
        page.goto(f"/sandboxes/{sandbox_id}/")
        expect(page.locator("#files")).to_contain_text("This directory is empty")
        page.set_input_files("#upload-file", str(source))
        page.get_by_role("button", name="Upload here").click()
        expect(page.locator(".upload-message")).to_contain_text("Uploaded /workspace/weights.bin")
        entry = page.locator('#files tr[data-entry="weights.bin"]')
        expect(entry).to_contain_text("293.2 KiB")
        with page.expect_download() as info:
            entry.get_by_role("link", name="Download").click()
        downloaded = tmp_path / "downloaded.bin"
        info.value.save_as(downloaded)
        assert downloaded.read_bytes() == payload

        page.locator("#sandbox-header").get_by_role("button", name="Delete").click()
        dialog = page.locator("#confirm-dialog")
        expect(dialog).to_contain_text(f"Delete sandbox {sandbox_id}?")
        dialog.get_by_role("button", name="Cancel").click()
        expect(page.locator("#sandbox-header [data-state]")).to_have_text("ready")
        page.locator("#sandbox-header").get_by_role("button", name="Delete").click()
        dialog.get_by_role("button", name="Yes, do it").click()
        expect(page.locator("#sandbox-header [data-state]")).to_have_text("deleted", timeout=60_000)
        expect(page.locator("#timeline")).to_contain_text("terminating → deleted")
    assert console.errors == []
    assert Sandbox.objects.get(tenant=tenant).state == State.DELETED


def test_it_creates_a_key_shown_once_that_works_and_revokes_it(live, make_tenant, make_user):
    tenant, _ = make_tenant()
    make_user("dana", (tenant, "owner"))
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "dana", "dana")
        page.get_by_role("link", name="API keys").click()
        page.get_by_label("Name").fill("eval-harness")
        page.get_by_label("admin").uncheck()
        page.get_by_label("Expires").select_option(label="30 days")
        page.get_by_role("button", name="Create key").click()
        secret = page.locator("#new-key-secret").inner_text()
        assert secret.startswith("hr_")
        page.get_by_role("button", name="Copy the new key").click()
        assert page.evaluate("navigator.clipboard.readText()") == secret
        # post/redirect/get: the page is a GET now, so a reload issues nothing new
        page.reload()
        expect(page.locator("#new-key-secret")).to_have_count(0)
        # (one key only: the .get() at the end would raise on two)
        row = page.locator("#keys-table tr", has_text="eval-harness")
        expect(row).to_contain_text(secret[:11])
        expect(row).to_contain_text("read")
        with httpx.Client(base_url=live.url, trust_env=False) as raw:
            auth = {"Authorization": f"Bearer {secret}"}
            assert raw.get("/api/v1/sandboxes", headers=auth).status_code == 200
            page.goto("/keys/")
            expect(page.locator("#new-key-secret")).to_have_count(0)  # shown once
            expect(row).not_to_contain_text("never")  # last used is recorded
            row.get_by_role("button", name="Revoke eval-harness").click()
            page.locator("#confirm-dialog").get_by_role("button", name="Yes, do it").click()
            expect(row.locator(".badge")).to_have_text("revoked")
            assert raw.get("/api/v1/sandboxes", headers=auth).status_code == 401
    assert console.errors == []
    key = tenant.api_keys.get(name="eval-harness")
    assert key.revoked_at is not None
    assert key.scopes == ["read", "write"]
    assert key.expires_at is not None


def test_it_shows_a_viewer_no_write_controls_and_the_server_refuses_them(
    live, make_tenant, make_user
):
    tenant, secret = make_tenant()
    make_user("vic", (tenant, "viewer"))
    make_user("newbie")
    sandbox_id = _create_ready(_api(live, secret))
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "vic", "vic")
        expect(page.locator(f'tr[data-sandbox-id="{sandbox_id}"]')).to_be_visible()
        expect(page.get_by_role("button", name="Create sandbox")).to_have_count(0)
        expect(page.get_by_role("button", name=f"Delete {sandbox_id}")).to_have_count(0)
        expect(page.get_by_role("link", name="API keys")).to_have_count(0)
        page.goto(f"/sandboxes/{sandbox_id}/")
        expect(page.locator("#files")).to_be_visible()
        for absent in ("Open terminal", "Run", "Delete", "Upload here"):
            expect(page.get_by_role("button", name=absent, exact=True)).to_have_count(0)
        page.get_by_role("link", name="Members").click()
        expect(page.get_by_role("button", name="Add member")).to_have_count(0)

        token = page.locator('meta[name="csrf-token"]').get_attribute("content")
        headers = {"X-CSRFToken": token or ""}
        refused = [
            page.request.post("/sandboxes/new", form={"image": "host"}, headers=headers),
            page.request.post(f"/sandboxes/{sandbox_id}/delete", headers=headers),
            page.request.post(
                "/members/", form={"action": "add", "username": "newbie"}, headers=headers
            ),
            page.request.post("/keys/", form={"name": "x", "scopes": "read"}, headers=headers),
            page.request.post("/api/v1/sandboxes", data={"image": "host"}, headers=headers),
            page.request.delete(f"/api/v1/sandboxes/{sandbox_id}", headers=headers),
            page.request.post(
                f"/api/v1/sandboxes/{sandbox_id}/exec", data={"command": "true"}, headers=headers
            ),
        ]
        assert [r.status for r in refused] == [403] * len(refused)
        assert page.request.get(f"/api/v1/sandboxes/{sandbox_id}").status == 200
    assert console.errors == []
    assert list(Sandbox.objects.filter(tenant=tenant).values_list("state", flat=True)) == [
        State.READY
    ]
    assert tenant.memberships.count() == 1
    assert not tenant.api_keys.filter(name="x").exists()


def test_it_never_shows_one_teams_sandboxes_to_another(live, make_tenant, make_user):
    team_a, secret_a = make_tenant()
    team_b, secret_b = make_tenant()
    team_c, secret_c = make_tenant()
    make_user("erin", (team_a, "member"), (team_c, "viewer"))
    a_id = _api(live, secret_a).post("/sandboxes", json={"image": "host"}).json()["id"]
    b_id = _api(live, secret_b).post("/sandboxes", json={"image": "host"}).json()["id"]
    c_id = _api(live, secret_c).post("/sandboxes", json={"image": "host"}).json()["id"]
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "erin", "erin")
        table = page.locator("#sandbox-table")
        expect(table.locator(f'tr[data-sandbox-id="{a_id}"]')).to_be_visible()
        for other in (b_id, c_id):
            expect(table.locator(f'tr[data-sandbox-id="{other}"]')).to_have_count(0)
        for path in (
            f"/sandboxes/{b_id}/",
            f"/api/v1/sandboxes/{b_id}",
            f"/sandboxes/{b_id}/files",
        ):
            assert page.request.get(path).status == 404, path

        page.get_by_label("Team").select_option(label=team_c.name)
        expect(table.locator(f'tr[data-sandbox-id="{c_id}"]')).to_be_visible()
        expect(table.locator(f'tr[data-sandbox-id="{a_id}"]')).to_have_count(0)
        expect(page.locator(".topbar")).to_contain_text("erin · viewer")
        assert page.request.get(f"/api/v1/sandboxes/{a_id}").status == 404
        # Another team's live events never reach this page: B's sandbox changes state
        # while we watch, and C's table still shows only C.
        _api(live, secret_b).delete(f"/sandboxes/{b_id}")
        expect(table.locator(f'tr[data-sandbox-id="{b_id}"]')).to_have_count(0)
    assert console.errors == []


def test_it_lets_an_owner_add_a_member_and_change_roles(live, make_tenant, make_user):
    tenant, _ = make_tenant()
    make_user("olga", (tenant, "owner"))
    make_user("pete")
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "olga", "olga")
        page.get_by_role("link", name="Members").click()
        page.get_by_label("Username").fill("nobody")
        page.get_by_role("button", name="Add member").click()
        expect(page.locator("#e-username")).to_contain_text("no user named 'nobody'")
        page.get_by_label("Username").fill("pete")
        page.get_by_label("Role", exact=True).select_option("viewer")
        page.get_by_role("button", name="Add member").click()
        expect(page.locator(".flash")).to_contain_text("Added pete as viewer")
        row = page.locator('#members-table tr[data-username="pete"]')
        row.get_by_label("Role of pete").select_option("admin")
        row.get_by_role("button", name="Save").click()
        expect(page.locator(".flash")).to_contain_text("pete is now admin")
        me = page.locator('#members-table tr[data-username="olga"]')
        me.get_by_label("Role of olga").select_option("member")
        me.get_by_role("button", name="Save").click()
        expect(page.locator(".form-error")).to_contain_text("at least one owner")
        page.goto("/members/")
    assert console.errors == []
    roles = dict(tenant.memberships.values_list("user__username", "role"))
    assert roles == {"olga": "owner", "pete": "admin"}
