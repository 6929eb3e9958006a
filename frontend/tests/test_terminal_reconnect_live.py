"""Issue 24, defect 9: the terminal survives a dropped connection with a labelled state
("Reconnecting… updates paused"), the reopened shell keeps its directory and exported
variables, bash's history stays out of /workspace, Tab is not a trap (Esc then Tab
leaves), and the top bar's live-updates dot says in words when its socket is lost.

Drops are real: Playwright's WebSocket routing proxies the page's sockets to the real
server, and the test closes both sides of one (the server sees its client go and the
agent kills the shell), then refuses new connections until it lets them through again.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, WebSocketRoute, expect

from frontend.tests.browser import (
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("assets")]


class Link:
    """Proxies one family of the page's websockets. ``drop()`` cuts the open ones; while
    dropped, a new one is held unanswered (the page's socket opens to nothing, as behind
    a dead proxy) until ``restore()`` closes it, so the page's next retry gets through."""

    def __init__(self, page: Page, pattern: str) -> None:
        self.blocked = False
        self.open: list[tuple[WebSocketRoute, WebSocketRoute]] = []
        self.held: list[WebSocketRoute] = []
        page.route_web_socket(re.compile(pattern), self._route)

    def _route(self, ws: WebSocketRoute) -> None:
        if self.blocked:
            self.held.append(ws)  # not connected to the server: nothing answers
            return
        self.open.append((ws, ws.connect_to_server()))

    def drop(self, *, hold: bool) -> None:
        self.blocked = hold
        for page_side, server_side in self.open:
            server_side.close(code=1001, reason="test: link down")
            page_side.close(code=1001, reason="test: link down")
        self.open.clear()

    def restore(self) -> None:
        self.blocked = False
        for page_side in self.held:
            page_side.close(code=1001, reason="test: link down")
        self.held.clear()


# Records every text #live-label shows and whether it was visible then.
_RECORD_LABEL = """() => {
  window.__labels = [];
  const label = document.getElementById('live-label');
  new MutationObserver(() => window.__labels.push([label.textContent,
      getComputedStyle(label).position, label.getBoundingClientRect().width > 1]))
    .observe(label, { childList: true, characterData: true, subtree: true, attributes: true });
}"""


def _terminal_line(page: Page, text: str) -> None:
    page.wait_for_function(
        "(t) => [...document.querySelectorAll('#terminal .xterm-rows > div')]"
        ".some(d => d.textContent.trim() === t)",
        arg=text,
    )


def _focus_in_terminal(page: Page) -> bool:
    return bool(page.evaluate("!!document.activeElement.closest('#terminal')"))


def test_the_terminal_reconnects_keeps_cwd_and_env_and_lets_tab_out(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, secret = make_tenant()
    make_user("tess", (tenant, "member"))
    http = httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )
    created = http.post("/sandboxes", json={"image": "host"})
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["id"]
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).status_code == 200

    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        pty = Link(page, r"/ws/v1/sandboxes/[^/]+/pty$")
        updates = Link(page, r"/ws/realtime")
        sign_in(page, "tess", "tess")
        page.goto(f"/sandboxes/{sandbox_id}/")
        expect(page.locator("#live-label")).to_have_text("Live updates on")

        page.get_by_role("button", name="Open terminal").click()
        status = page.locator("#terminal-status")
        expect(status).to_contain_text("connected")
        terminal = page.locator("#terminal")
        first_pid = terminal.get_attribute("data-pid")
        assert first_pid
        terminal.click()
        page.keyboard.type("mkdir -p /workspace/proj/sub && cd /workspace/proj/sub\n")
        page.keyboard.type("export DEMO_VAR=kept-value\n")
        # the prompt after a command saved the shell's state and reported its directory
        expect(terminal).to_have_attribute("data-cwd", "/workspace/proj/sub")
        page.keyboard.type("echo saved\n")
        _terminal_line(page, "saved")
        expect(terminal).to_have_attribute("data-cwd", "/workspace/proj/sub")

        # the connection drops: a labelled state while nothing answers
        pty.drop(hold=True)
        expect(status).to_have_text("Reconnecting… updates paused")
        expect(status).to_have_attribute("role", "status")
        page.wait_for_function(
            "() => [...document.querySelectorAll('#terminal .xterm-rows > div')]"
            ".some(d => d.textContent.includes('[connection lost; reconnecting]'))"
        )
        assert sideways_overflow(page) == []  # the long label wraps on a phone
        assert axe_violations(page) == []
        pty.restore()
        expect(status).to_contain_text("connected")
        second_pid = terminal.get_attribute("data-pid")
        assert second_pid and second_pid != first_pid, "not a new shell"
        # the new shell is where the old one was, with its exported variable
        expect(terminal).to_have_attribute("data-cwd", "/workspace/proj/sub")
        terminal.click()
        page.keyboard.type('echo "at=$PWD var=$DEMO_VAR"\n')
        _terminal_line(page, "at=/workspace/proj/sub var=kept-value")

        # the page's live-updates socket: its loss is said in words, visibly, until back
        page.evaluate(_RECORD_LABEL)
        updates.drop(hold=False)
        page.wait_for_function(
            "() => window.__labels.some(l => l[0] === 'Reconnecting… updates paused'"
            " && l[1] === 'fixed' && l[2])"
        )
        label = page.locator("#live-label")
        expect(label).to_have_text("Live updates on")
        expect(label).to_have_class(re.compile(r"\bsr-only\b"))

        # Tab completes in the shell; Esc then Tab moves focus out of the terminal
        terminal.click()
        page.keyboard.type("ech")
        page.keyboard.press("Tab")
        assert _focus_in_terminal(page), "Tab left the terminal instead of completing"
        page.keyboard.press("Control+u")
        page.keyboard.press("Escape")
        page.keyboard.press("Tab")
        assert not _focus_in_terminal(page), "Esc then Tab did not leave the terminal"
        assert page.evaluate("document.activeElement !== document.body")
        page.keyboard.press("Shift+Tab")
        terminal.click()
        page.keyboard.press("Control+c")
        page.keyboard.type("exit 0\n")
        expect(status).to_contain_text("exited with code 0")
        # a closed terminal reopened in the same tab: the same directory again
        page.get_by_role("button", name="Close terminal").click()
        page.get_by_role("button", name="Open terminal").click()
        expect(status).to_contain_text("connected")
        expect(terminal).to_have_attribute("data-cwd", "/workspace/proj/sub")
        page.get_by_role("button", name="Close terminal").click()
        expect(status).to_have_text("closed")
    assert console.errors == []

    # bash's history went to /tmp, not among the user's files in /workspace
    listing = http.get(f"/sandboxes/{sandbox_id}/files/list", params={"path": "/workspace"})
    assert listing.status_code == 200, listing.text
    assert ".bash_history" not in listing.text
    ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "cat /tmp/.bash_history"})
    assert ran.status_code == 200, ran.text
    assert "export DEMO_VAR=kept-value" in ran.json()["stdout"]
    assert http.delete(f"/sandboxes/{sandbox_id}").status_code in (200, 202, 204)
