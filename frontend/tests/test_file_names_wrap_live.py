"""Issue 24, defect 6, last item: long file names in the file browser wrap after their
separators (``_ - . /``, camelCase humps), not at whatever letter reaches the edge, and
the page still fits a phone. Real Chromium, real sandbox; the line breaks are measured
from the rendered characters' positions."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from frontend.tests.browser import (
    PHONE,
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]

FILE = "an_extremely_long_file_name-for_the_wrapping_check.of_issue_24.tar.gz"
DIRECTORY = "someVeryLongCamelCaseDirectoryNameWithoutSeparators"

# For one entry's name cell: the pairs of characters a line break falls between.
_BREAKS = """(name) => {
  const cell = document.querySelector(`#files tr[data-entry="${name}"] td.name`);
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  const chars = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    for (let i = 0; i < n.textContent.length; i++) {
      if (!n.textContent[i].trim()) continue;
      const range = document.createRange();
      range.setStart(n, i);
      range.setEnd(n, i + 1);
      const rect = range.getClientRects()[0];
      if (rect) chars.push([n.textContent[i], rect.top]);
    }
  }
  const breaks = [];
  for (let i = 1; i < chars.length; i++) {
    if (chars[i][1] > chars[i - 1][1] + 2) breaks.push(chars[i - 1][0] + chars[i][0]);
  }
  return breaks;
}"""


def _at_a_separator(pair: str) -> bool:
    before, after = pair[0], pair[1]
    return before in "_-./" or (before.islower() and after.isupper())


def test_long_names_wrap_after_separators_not_mid_word(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, secret = make_tenant()
    make_user("wren", (tenant, "member"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http)
    put = http.put(f"/sandboxes/{sandbox_id}/files", params={"path": f"/workspace/{FILE}"})
    assert put.status_code == 200, put.text
    made = http.post(
        f"/sandboxes/{sandbox_id}/files/mkdir", params={"path": f"/workspace/{DIRECTORY}"}
    )
    assert made.status_code in (200, 201), made.text
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "wren", "wren")
        page.set_viewport_size(PHONE)
        page.goto(f"/sandboxes/{sandbox_id}/")
        expect(page.locator(f'#files tr[data-entry="{FILE}"]')).to_have_count(1)
        for name in (FILE, DIRECTORY):
            breaks = page.evaluate(_BREAKS, name)
            assert breaks, f"{name} did not wrap on a phone (the test proves nothing)"
            mid_word = [pair for pair in breaks if not _at_a_separator(pair)]
            assert mid_word == [], f"{name} broke mid-word at {mid_word} (all: {breaks})"
        # the name reads whole to the accessibility tree and the page fits both screens
        expect(page.locator(f'#files tr[data-entry="{FILE}"] td.name')).to_have_text(FILE)
        assert sideways_overflow(page) == []
        assert axe_violations(page) == []
    assert console.errors == []
