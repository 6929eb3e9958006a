"""Real Chromium (Debian's package) driven by Playwright against the live stack."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    Page,
    ViewportSize,
    expect,
    sync_playwright,
)
from playwright.sync_api import (
    TimeoutError as PlaywrightTimeout,
)

ROOT = Path(__file__).resolve().parents[2]
# `make test` must leave the working tree clean: screenshots go to a scratch directory
# unless HEDGEROW_UPDATE_SCREENSHOTS=1 asks for the README's copies to be refreshed.
SCREENSHOTS = (
    ROOT / "docs" / "screenshots"
    if os.environ.get("HEDGEROW_UPDATE_SCREENSHOTS") == "1"
    else Path(os.environ.get("TMPDIR", "/tmp")) / "hedgerow-screenshots"
)
CHROMIUM = "/usr/bin/chromium"
# axe-core from npm (frontend/package.json devDependencies; `npm ci` installs it),
# injected into the page under test: never a CDN.
AXE = ROOT / "frontend" / "node_modules" / "axe-core" / "axe.min.js"
# Flags that keep Chromium off the network (the tests may only talk to loopback).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


# The machine is shared and small: wait generously for things that must happen, since
# a waiting expect() costs nothing when the page is quick.
expect.set_options(timeout=20_000)


@dataclass
class Console:
    """Every console error and uncaught page error, so a test can assert there were none."""

    errors: list[str] = field(default_factory=list)

    def attach(self, page: Page) -> None:
        def on_console(message: ConsoleMessage) -> None:
            if os.environ.get("HEDGEROW_BROWSER_DEBUG"):
                print(f"[browser {message.type}] {message.text}")
            if message.type == "error":
                self.errors.append(f"console: {message.text} @ {message.location}")

        page.on("console", on_console)
        if os.environ.get("HEDGEROW_BROWSER_DEBUG"):
            page.on(
                "response",
                lambda r: print(f"[browser http] {r.status} {r.url}") if r.status >= 400 else None,
            )
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))


@contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser: Browser, base_url: str, console: Console, **kwargs: Any) -> Page:
    context = browser.new_context(
        base_url=base_url,
        viewport={"width": 1280, "height": 800},  # a laptop screen
        accept_downloads=True,
        **kwargs,
    )
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base_url)
    page = context.new_page()
    page.set_default_timeout(30_000)
    console.attach(page)
    return page


def sign_in(page: Page, username: str, password: str) -> None:
    page.goto("/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/sandboxes/")


def screenshot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    # A scrolled page (focus moved into the terminal) shoots its sticky top bar midway.
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


# The two screens issue 24 names: a laptop and a phone.
DESKTOP: ViewportSize = {"width": 1440, "height": 900}
PHONE: ViewportSize = {"width": 390, "height": 844}


# The innermost elements sticking out past the viewport's right edge: what to fix.
_WIDE_ELEMENTS = """() => {
  const W = window.innerWidth + 1;
  const name = (e) => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') +
    (typeof e.className === 'string' && e.className
      ? '.' + e.className.trim().split(/\\s+/).join('.') : '');
  const wide = [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > W)
    .filter(e => ![...e.children].some(c => c.getBoundingClientRect().right > W))
    .map(e => [name(e), e.getBoundingClientRect().right]);
  // text overflowing a narrower box (white-space: nowrap) sticks out too
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const range = document.createRange();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.textContent.trim()) continue;
    range.selectNodeContents(n);
    const right = range.getBoundingClientRect().right;
    if (right > W) wide.push(['text in ' + name(n.parentElement), right]);
  }
  return wide.sort((a, b) => b[1] - a[1]).slice(0, 6)
    .map(([what, right]) => what + ':' + Math.round(right));
}"""


def sideways_overflow(page: Page) -> list[str]:
    """For each of DESKTOP and PHONE: "WxH: scrollWidth > innerWidth [culprits]" when the
    document scrolls sideways (a wide table must scroll inside its own box, not the
    page). Charts re-fit a beat after a resize (ResizeObserver), so the page gets a
    moment to settle; an overflow that is still there after it is reported."""
    found = []
    for size in (DESKTOP, PHONE):
        page.set_viewport_size(size)
        try:
            page.wait_for_function(
                "document.scrollingElement.scrollWidth <= window.innerWidth", timeout=3_000
            )
        except PlaywrightTimeout:
            widths = page.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")
            culprits = page.evaluate(_WIDE_ELEMENTS)
            found.append(f"{size['width']}x{size['height']}: {widths[0]} > {widths[1]} {culprits}")
    page.set_viewport_size({"width": 1280, "height": 800})
    return found


def axe_violations(page: Page, impacts: tuple[str, ...] = ("serious", "critical")) -> list[str]:
    """axe-core's violations of the page as it is now, at ``impacts``, on both screens
    issue 24 names (DESKTOP and PHONE: a phone layout hides, stacks and wraps things
    differently): "WIDTHpx: rule-id (impact): selector, …" per rule, so a failing
    assertion names what to fix and where. The viewport is put back afterwards."""
    if not AXE.exists():
        raise AssertionError(f"{AXE} is missing: run `scripts/stack.sh install` (npm ci)")
    before = page.viewport_size
    found: list[str] = []
    try:
        for size in (DESKTOP, PHONE):
            page.set_viewport_size(size)
            found += [f"{size['width']}px: {v}" for v in _axe_run(page, impacts)]
    finally:
        if before is not None:
            page.set_viewport_size(before)
    return found


def _axe_run(page: Page, impacts: tuple[str, ...]) -> list[str]:
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.add_script_tag(path=str(AXE))
    found = page.evaluate(
        """async (impacts) => {
          const result = await window.axe.run(document, { resultTypes: ["violations"] });
          return result.violations
            .filter(v => impacts.includes(v.impact))
            .map(v => `${v.id} (${v.impact}): ` +
                 v.nodes.slice(0, 5).map(n => n.target.join(" ")).join(", "));
        }""",
        list(impacts),
    )
    return list(found)
