"""The Datasets, data card and matrix pages in real Chromium against the live stack,
with axe-core. Rows are set up before the browser opens (Playwright's sync API runs an
event loop, under which Django refuses ORM calls) and checked after it closes."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from apps.datasets.models import Dataset, DatasetEpisode
from apps.datasets.services.tasks import reference_record, task_upsert
from apps.datasets.tests.factories import closed_episode
from frontend.tests.browser import (
    PHONE,
    Console,
    axe_violations,
    chromium,
    new_page,
    screenshot,
    sideways_overflow,
    sign_in,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("assets")]


def test_it_creates_a_dataset_shows_its_card_and_the_matrix(
    live: Any, make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    make_user("dana", (tenant, "member"))
    task_upsert(tenant=tenant, task_id="t1", metadata={"affected_files": ["a.py"]}, licence="MIT")
    task_upsert(tenant=tenant, task_id="t2", metadata={"affected_files": ["a.py"]}, licence="")
    for policy, harness, task, cls in (
        ("p0", "A", "t1", "task"), ("p1", "A", "t1", "success"),
        ("p0", "B", "t1", "task"), ("p1", "B", "t1", "success"),
        ("p0", "A", "t2", "task"), ("p1", "A", "t2", "task"),
        ("p0", "B", "t2", "task"), ("p1", "B", "t2", "success"),
        ("p0", "A", "t3", "environment"), ("p0", "A", "t3", "environment"),
        ("p0", "A", "t3", "startup"), ("p0", "A", "t3", "task"),
    ):  # fmt: skip
        closed_episode(tenant, task, cls, policy_version=policy, harness=harness, model="m")
    # t4's verifier errs on its reference: suspect, with the run shown as evidence
    reference_record(
        tenant=tenant,
        task_id="t4",
        data={"task_version": "v1", "verifier_version": "2", "reference_outcome": "error"},
        actor="dana",
    )
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "dana", "dana")
        page.get_by_role("link", name="Datasets").click()
        page.wait_for_url("**/datasets/")
        # t3's failures are mostly infrastructure: held back as broken, not served as hard
        expect(page.locator("#quarantine tr[data-task-id=t3]")).to_contain_text(
            "mostly_infra_failures"
        )
        expect(page.locator("#quarantine tr[data-task-id=t4] .reference-run")).to_contain_text(
            "Reference run (client, task v1, verifier 2): reference error"
        )
        assert axe_violations(page) == []
        page.get_by_label("Name", exact=True).fill("by files")
        page.get_by_label("Group by").select_option("affected_files")
        page.get_by_label("Train", exact=True).fill("0.5")
        page.get_by_label("Validation", exact=True).fill("0")
        page.get_by_label("Test", exact=True).fill("0.5")
        page.get_by_role("button", name="Create dataset").click()
        page.wait_for_url("**/datasets/ds-*/")
        card_path = "/" + page.url.split("/", 3)[3]
        expect(page.locator("#leak-check")).to_have_text(
            "no group, task or key value in two splits"
        )
        expect(page.locator("[data-stat=episodes] .v")).to_have_text("12")
        expect(page.locator("#card-licences")).to_contain_text("MIT 1")
        # t1 and t2 share a.py: one group of 8 episodes, 3 successes and 5 task failures
        grouped = page.locator(
            "#splits tr", has=page.locator("td[data-col=episodes]", has_text="8")
        )
        expect(grouped.locator("td[data-class=success]")).to_have_text("3")
        expect(grouped.locator("td[data-class=task]")).to_have_text("5")
        expect(grouped.locator("td[data-class=startup]")).to_have_text("0")
        expect(page.locator("#card-scan")).to_contain_text("0 of 12 episodes held secrets")
        assert sideways_overflow(page) == [] and axe_violations(page) == []
        screenshot(page, "dataset-card")

        page.goto("/datasets/matrix?policies=p0,p1&harnesses=A,B")
        # paired t1, t2: S(p1,A) = (1 + 0)/2, S(p1,B) = 1; S(p0,·) = 0 → Δ_int = 1 − 0.5
        expect(page.locator("[data-cell='p1|A'] .s")).to_have_text("50.0 %")
        expect(page.locator("[data-cell='p1|B'] .s")).to_have_text("100.0 %")
        expect(page.locator("#interaction strong")).to_have_text("0.500")
        assert axe_violations(page) == []
        screenshot(page, "matrix")

        # a phone: no page of this family (nor the Trajectories page with its time
        # panel) scrolls sideways, and the nav with its new entry still fits
        page.set_viewport_size(PHONE)
        for path in (
            "/datasets/",
            card_path,
            "/datasets/matrix?policies=p0,p1&harnesses=A,B",
            "/trajectories/",
        ):
            page.goto(path)
            assert sideways_overflow(page) == [], path
            assert axe_violations(page) == [], path
    assert console.errors == []
    dataset = Dataset.objects.get(tenant=tenant)
    splits = {
        m.episode.task_id: m.split
        for m in DatasetEpisode.objects.filter(dataset=dataset).select_related("episode")
    }
    assert splits["t1"] == splits["t2"]  # they share a.py
