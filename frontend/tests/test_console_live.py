"""Large command output does not freeze the tab (issue 24, defect 2), in Chromium at
1440x900 and 390x844: `seq 1 200000` renders into a bounded ring (the last MAX_LINES
lines, never more in the page while it streams), follows the tail, and says "N earlier
lines omitted — download full output", a link to the stored operation's download,
which another team cannot fetch."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import ViewportSize, expect

from frontend.tests.browser import (
    DESKTOP,
    PHONE,
    Console,
    axe_violations,
    chromium,
    new_page,
    sideways_overflow,
    sign_in,
)
from frontend.tests.test_dashboard_live import _api, _create_ready

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("assets")]

MAX_LINES = 2000  # frontend/src/console.ts


def _notice(omitted: int) -> re.Pattern[str]:
    """The console's notice; lines skipped while the view fell behind are counted in."""
    return re.compile(
        rf"^{omitted:,} earlier lines omitted"
        r"( \([\d,]+ of them skipped while the view fell behind\))? — download full output\s*$"
    )


# Records, at every DOM change of the console, its newline count and node count: the
# most it ever held while the output streamed, not only what is left at the end.
_WATCH = """() => {
  const out = document.querySelector('#exec-output');
  window.__peak = { lines: 0, nodes: 0 };
  new MutationObserver(() => {
    const text = out.textContent;
    let lines = 0;
    for (let i = text.indexOf('\\n'); i >= 0; i = text.indexOf('\\n', i + 1)) lines += 1;
    const nodes = document.createTreeWalker(out, NodeFilter.SHOW_ALL);
    let count = 0;
    while (nodes.nextNode()) count += 1;
    window.__peak.lines = Math.max(window.__peak.lines, lines);
    window.__peak.nodes = Math.max(window.__peak.nodes, count);
  }).observe(out, { childList: true, subtree: true, characterData: true });
}"""


@pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_large_output_stays_bounded_follows_the_tail_and_downloads_whole(
    live: Any, make_tenant: Any, make_user: Any, tmp_path: Path, size: ViewportSize
) -> None:
    tenant, secret = make_tenant()
    other, _ = make_tenant()
    make_user("lena", (tenant, "member"))
    make_user("otto", (other, "owner"))
    sandbox_id = _create_ready(_api(live, secret))
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.set_viewport_size(size)
        sign_in(page, "lena", "lena")
        page.goto(f"/sandboxes/{sandbox_id}/")
        page.evaluate(_WATCH)
        page.get_by_label("Command", exact=True).fill("seq 1 200000")
        page.get_by_role("button", name="Run", exact=True).click()
        expect(page.locator("#exec-status")).to_contain_text("exit code 0")
        output = page.locator("#exec-output")
        expect(output).to_contain_text("\n200000")

        peak = page.evaluate("window.__peak")
        # the ring never held more than its lines (+1: the notice's own line) and a
        # handful of nodes (notice, one span per stream run, their text nodes)
        assert peak["lines"] <= MAX_LINES + 1 and peak["nodes"] <= 40, peak
        kept = [line for line in output.inner_text().splitlines() if line.isdigit()]
        assert len(kept) == MAX_LINES and kept[-1] == "200000", (len(kept), kept[-3:])
        assert [int(x) for x in kept] == list(range(int(kept[0]), 200001))  # a contiguous tail
        omitted = int(kept[0]) - 1
        notice = output.locator(".console-omitted")
        expect(notice).to_have_text(_notice(omitted))
        # follow-tail: the console shows the last line, scrolled to its bottom
        assert page.evaluate(
            "(o => o.scrollHeight - o.scrollTop - o.clientHeight < 2)"
            "(document.querySelector('#exec-output'))"
        )
        assert sideways_overflow(page) == []
        page.set_viewport_size(size)
        assert axe_violations(page) == []

        link = notice.get_by_role("link", name="download full output")
        href = link.get_attribute("href") or ""
        assert href.startswith(f"/sandboxes/{sandbox_id}/operations/web-") and href.endswith(
            "/output.txt"
        )
        with page.expect_download() as info:
            link.click()
        saved = tmp_path / "output.txt"
        info.value.save_as(saved)
        body = saved.read_text()
        # 1.3 MB of stdout is stored as its first and last 512 KiB with a marker between
        lines = body.splitlines()
        assert lines[:3] == ["1", "2", "3"] and lines[-1] == "200000"
        assert sum(1 for line in lines if line.startswith("[… ")) == 1

        outsider = new_page(browser, live.url, console)
        sign_in(outsider, "otto", "otto")
        assert outsider.request.get(live.url + href).status == 404  # tenancy-checked
    assert [e for e in console.errors if "output.txt" not in e] == []


@pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_scrolled_up_the_console_stays_put_and_at_the_bottom_it_follows(
    live: Any, make_tenant: Any, make_user: Any, size: ViewportSize
) -> None:
    """Follow-tail only while the reader is at the bottom: scrolled up to read, new
    output must not yank the view down. The command blocks reading a FIFO the test
    writes through the API once the reader has scrolled (no sleeps anywhere)."""
    tenant, secret = make_tenant()
    make_user("finn", (tenant, "member"))
    http = _api(live, secret)
    sandbox_id = _create_ready(http)
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.set_viewport_size(size)
        sign_in(page, "finn", "finn")
        page.goto(f"/sandboxes/{sandbox_id}/")
        page.get_by_label("Command", exact=True).fill(
            "mkfifo /tmp/go; seq 1 1500; read x < /tmp/go; seq 1501 1600"
        )
        page.get_by_role("button", name="Run", exact=True).click()
        output = page.locator("#exec-output")
        expect(output).to_contain_text("\n1500\n")
        at_bottom = (
            "(o => o.scrollHeight - o.scrollTop - o.clientHeight < 2)"
            "(document.querySelector('#exec-output'))"
        )
        page.wait_for_function(at_bottom)  # following while at the bottom
        output.evaluate("o => { o.scrollTop = 0; }")  # the reader scrolls up
        released = http.post(
            f"/sandboxes/{sandbox_id}/exec", json={"command": "echo go > /tmp/go", "timeout": 30}
        )
        assert released.status_code == 200, released.text
        expect(page.locator("#exec-status")).to_contain_text("exit code 0")
        expect(output).to_contain_text("\n1600")
        assert output.evaluate("o => o.scrollTop") == 0  # not yanked to the new lines
    assert console.errors == []


@pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_three_megabytes_of_output_finish_rendering(
    live: Any, make_tenant: Any, make_user: Any, size: ViewportSize
) -> None:
    """3 MB of output stayed "running…" for 40 s: it ends with its exit line, the
    console bounded, the stored windows' size named and the download offered."""
    tenant, secret = make_tenant()
    make_user("gus", (tenant, "member"))
    sandbox_id = _create_ready(_api(live, secret))
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.set_viewport_size(size)
        sign_in(page, "gus", "gus")
        page.goto(f"/sandboxes/{sandbox_id}/")
        page.evaluate(_WATCH)
        # 30,000 lines of 100 characters (3 MB), the last one recognisable
        page.get_by_label("Command", exact=True).fill(
            "yes 0123456789012345678901234567890123456789012345678901234567890123456789"
            "01234567890123456789012345678 | head -n 29999; echo the-end"
        )
        page.get_by_role("button", name="Run", exact=True).click()
        status = page.locator("#exec-status")
        expect(status).to_contain_text("exit code 0", timeout=60_000)
        expect(status).to_contain_text("stdout truncated")
        output = page.locator("#exec-output")
        expect(output).to_contain_text("\nthe-end")
        peak = page.evaluate("window.__peak")
        assert peak["lines"] <= MAX_LINES + 1 and peak["nodes"] <= 40, peak
        # exact whether or not the view fell behind the server's replay window (then
        # the lines it never got are counted from the exec.gap frame's size)
        expect(output.locator(".console-omitted")).to_have_text(_notice(28_000))
        assert sideways_overflow(page) == []
    assert console.errors == []


def test_lines_skipped_while_the_view_fell_behind_are_counted_exactly(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    """The browser side of an exec.gap (issue 18): the relay says what a view that fell
    behind its replay window never got, and the console counts it into "N earlier lines
    omitted". Deterministic: the page's socket is routed, its first 1,000 lines are held
    back and a gap frame with their exact size is sent instead (the server side of the
    size is apps/sandboxes/tests/test_feed_gap.py)."""
    tenant, secret = make_tenant()
    make_user("ivy", (tenant, "member"))
    sandbox_id = _create_ready(_api(live, secret))
    dropped: dict[str, Any] = {"lines": 0, "bytes": 0, "seqs": [], "gap_sent": False}

    def route(ws: Any) -> None:
        server = ws.connect_to_server()

        def from_server(message: str | bytes) -> None:
            frame = json.loads(message)
            # lines 1..1000 come before the command's pause: hold them all back
            if frame.get("type") == "exec.stdout" and dropped["lines"] < 1000:
                raw = base64.b64decode(frame["data"])
                dropped["lines"] += raw.count(b"\n")
                dropped["bytes"] += len(raw)
                dropped["seqs"].append(frame["seq"])
                return
            if dropped["seqs"] and not dropped["gap_sent"]:
                dropped["gap_sent"] = True
                ws.send(
                    json.dumps(
                        {
                            "type": "exec.gap",
                            "sandbox_id": frame["sandbox_id"],
                            "operation_id": frame["operation_id"],
                            "from_seq": dropped["seqs"][0],
                            "to_seq": dropped["seqs"][-1],
                            "skipped": {
                                "stdout": {"bytes": dropped["bytes"], "lines": dropped["lines"]},
                                "stderr": {"bytes": 0, "lines": 0},
                            },
                        }
                    )
                )
            ws.send(message)

        server.on_message(from_server)

    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        page.route_web_socket(re.compile(r".*/ws/realtime$"), route)
        sign_in(page, "ivy", "ivy")
        page.goto(f"/sandboxes/{sandbox_id}/")
        # 1,000 lines, a pause (so they leave in frames of their own), 29,000 more
        page.get_by_label("Command", exact=True).fill("seq 1 1000; sleep 1; seq 1001 30000")
        page.get_by_role("button", name="Run", exact=True).click()
        expect(page.locator("#exec-status")).to_contain_text("exit code 0", timeout=60_000)
        output = page.locator("#exec-output")
        expect(output).to_contain_text("\n30000")
        assert dropped["lines"] == 1000 and dropped["gap_sent"], dropped
        kept = [line for line in output.inner_text().splitlines() if line.isdigit()]
        assert [int(x) for x in kept] == list(range(28_001, 30_001))  # the contiguous tail
        expect(output.locator(".console-omitted")).to_have_text(
            "28,000 earlier lines omitted (1,000 of them skipped while the view fell behind)"
            " — download full output"
        )
        assert "no longer kept" not in output.inner_text()  # a sized gap is not a note
    assert console.errors == []
