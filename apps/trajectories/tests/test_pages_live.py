"""The Trajectories, Episode and Compare pages in real Chromium against the live stack.

Rows are set up before the browser opens and checked after it closes: Playwright's
sync API runs an event loop, under which Django refuses ORM calls.
"""

from __future__ import annotations

import time

import pytest
from django.utils import timezone
from hedgerow import Client
from playwright.sync_api import expect

from apps.sandboxes.models import Sandbox, State
from apps.trajectories.models import Episode, EpisodeRelabel
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


def _seed(tenant, task: str, cls: str) -> None:
    now = timezone.now()
    Episode.objects.create(
        tenant=tenant,
        task_id=task,
        status="closed",
        started_at=now,
        ended_at=now,
        auto_failure_class=cls,
        failure_class=cls,
        failure_evidence=[{"class": cls, "rule": "seeded", "decisive": True}],
    )


def _record_episodes(live, secret: str) -> tuple[str, str]:
    with Client(url=live.url, api_key=secret, max_retries=1) as hr, hr.create_sandbox() as sb:
        with sb.episode(task_id="make-file", model="m-1", harness="h") as solved:
            sb.exec("printf 'made\\n' > /workspace/answer && cat /workspace/answer")
            solved.step(action="I am done", kind="model", model_call={"tokens_in": 12})
            solved.verify("test -f /workspace/answer", timeout=10, name="exists")
        with sb.episode(task_id="make-file", model="m-2", harness="h") as failed:
            sb.exec("echo forgot; rm -f /workspace/answer")
            failed.verify("test -f /workspace/answer", timeout=10, name="exists")
        with sb.episode(task_id="slow", model="m-1", harness="h") as slow:
            slow.verify("sleep 30", timeout=1, name="slow")
    return solved.id, failed.id


def test_it_shows_numbers_timeline_relabel_and_compare_in_a_browser(live, make_tenant, make_user):
    tenant, secret = make_tenant()
    make_user("tess", (tenant, "owner"))
    solved_id, failed_id = _record_episodes(live, secret)
    _seed(tenant, "boot", "startup")
    _seed(tenant, "flaky-net", "environment")
    # N = 5: success, task, verifier, startup, environment → valid 2, η 40 %,
    # success 1/5 raw and 1/2 on valid infrastructure; 1 of 1 task with a valid run solved.
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "tess", "tess")
        page.get_by_role("link", name="Trajectories").click()
        page.wait_for_url("**/trajectories/")
        expect(page.locator("[data-stat=eta] .v")).to_have_text("40.0 %")
        expect(page.locator("[data-stat=success-raw] .v")).to_have_text("20.0 %")
        expect(page.locator("[data-stat=success-valid] .v")).to_have_text("50.0 %")
        expect(page.locator("[data-stat=tasks] .v")).to_have_text("1 / 1")
        for cls, count in (("success", "1"), ("task", "1"), ("verifier", "1"), ("startup", "1")):
            expect(page.locator(f"[data-count={cls}]")).to_have_text(count)
        expect(page.locator("[data-count=observation]")).to_have_text("0")
        expect(page.locator("#episodes tbody tr")).to_have_count(5)
        screenshot(page, "trajectories-list")

        page.get_by_label("Failure class", exact=True).select_option("task")
        page.get_by_role("button", name="Filter").click()
        expect(page.locator("#episodes tbody tr")).to_have_count(1)
        expect(page.locator("[data-stat=episodes] .v")).to_have_text("1")

        page.goto(f"/trajectories/{solved_id}/")
        timeline = page.locator("#episode-timeline")
        expect(timeline.locator("[data-step]")).to_have_count(3)
        expect(timeline.locator("pre.stdout").first).to_have_text("made\n")
        expect(timeline.locator("[data-event=ready]")).to_have_count(1)
        expect(page.locator("#evidence")).to_contain_text("verifier_pass")
        screenshot(page, "episode-detail")
        # issue 24, defect 12: axe-core and no sideways scrolling at 1440×900 and 390×844
        problems = {"detail": sideways_overflow(page) + axe_violations(page)}

        page.get_by_label("Relabel as").select_option("verifier")
        page.get_by_label("Reason").fill("the check only tests that the file exists")
        page.get_by_role("button", name="Relabel").click()
        expect(page.locator("#failure-class")).to_have_text("verifier")
        expect(page.locator("#relabels")).to_contain_text("success → verifier")

        page.get_by_label("Compare with").select_option(failed_id)
        page.get_by_role("button", name="Compare").click()
        page.wait_for_url("**/trajectories/compare?*")
        expect(page.locator("[data-side=a][data-index='0']")).to_contain_text("made")
        expect(page.locator("[data-side=b][data-index='0']")).to_contain_text("forgot")
        expect(page.locator("[data-side=a][data-index='1']")).to_contain_text("I am done")
        screenshot(page, "episode-compare")
        problems["compare"] = sideways_overflow(page) + axe_violations(page)
        assert console.errors == []
    assert {name: found for name, found in problems.items() if found} == {}

    relabel = EpisodeRelabel.objects.get(episode__episode_id=solved_id)
    assert (relabel.from_class, relabel.to_class, relabel.actor) == (
        "success",
        "verifier",
        "user:tess",
    )
    assert Episode.objects.get(episode_id=solved_id).auto_failure_class == "success"
    deadline = time.monotonic() + 60
    while Sandbox.objects.exclude(state__in=(State.DELETED, State.FAILED, State.LOST)).exists():
        assert time.monotonic() < deadline, "sandbox not destroyed"
        time.sleep(0.2)
