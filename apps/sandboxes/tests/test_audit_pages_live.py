"""The leak report (staff) and a team's leak page, in real Chromium against the stack."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import expect

from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import SandboxSpec
from apps.sandboxes.models import AuditRun, Sandbox, SandboxEvent, State
from apps.sandboxes.services.audit import AuditSlice, audit_run
from apps.sandboxes.services.lifecycle import sandbox_transition
from apps.sandboxes.tests.factories import make_sandbox
from apps.tenancy.services import membership_set_role
from frontend.tests.browser import Console, chromium, new_page, screenshot, sign_in

pytestmark = pytest.mark.timeout(180)


def _ended_with_resources(tenant: Any) -> Sandbox:
    """A sandbox the ledger says is deleted, whose netns/process/directory remain."""
    # Made by hand, not by sandbox_create: no provision task may race the ledger below.
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0, external_id=_new_id())
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=tenant, event="created", to_state=State.REQUESTED, reason="api"
    )
    for to_state, reason in (
        (State.PROVISIONING, "scheduled"),
        (State.READY, "agent_healthy"),
        (State.TERMINATING, "deleted"),
        (State.DELETED, "destroyed"),
    ):
        assert sandbox_transition(
            sandbox=sandbox,
            from_states=(sandbox.state,),
            to_state=to_state,
            reason=reason,
            bump_generation=to_state == State.PROVISIONING,
        )
    get_backend().provision(
        SandboxSpec(
            sandbox_id=sandbox.id.hex,
            tenant_id=str(tenant.pk),
            generation=sandbox.generation,
            image="host",
            cpu_millis=250,
            memory_mib=128,
            network_access=False,
            agent_token=uuid.uuid4().hex,
        )
    )
    return sandbox


def _new_id() -> str:
    return f"sb-{uuid.uuid4().hex[:12]}"


def _unexpected(errors: list[str], refused: tuple[str, ...]) -> list[str]:
    """Console errors but the admin sign-in page's favicon and the 403s the test asked
    for (the browser logs a refused page's status as an error)."""

    def expected(error: str) -> bool:
        if "/favicon.ico" in error:
            return True
        url = error.partition("'url': '")[2].partition("'")[0]
        return "status of 403" in error and url.endswith(refused)

    return [e for e in errors if not expected(e)]


def _sign_in_admin(page: Any, username: str) -> None:
    page.goto("/admin/login/?next=/reports/leaks")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(username)
    page.get_by_role("button", name="Log in").click()


def test_it_shows_staff_a_leak_with_its_ids_and_reclaims_it_from_the_page(
    live: Any, make_tenant: Any
) -> None:
    tenant, _ = make_tenant()
    leaked = _ended_with_resources(tenant)
    User.objects.create_user("ops", password="ops", is_staff=True)
    User.objects.create_user("mallory", password="mallory")
    console = Console()
    with chromium() as browser:
        outsider = new_page(browser, live.url, console)
        sign_in(outsider, "mallory", "mallory")  # no team, not staff
        outsider.goto("/reports/leaks")
        expect(outsider.locator("#staff-only")).to_be_visible()  # not staff: a way back
        expect(outsider.locator("#no-audit")).to_have_count(0)
        assert outsider.request.get(live.url + "/reports/leaks.json").status == 403

        page = new_page(browser, live.url, console)
        _sign_in_admin(page, "ops")
        page.wait_for_url("**/reports/leaks")
        expect(page.locator("#no-audit")).to_be_visible()

        # Audit without reconciling first, so the report shows the leak it then reclaims.
        page.get_by_label("reconcile first").uncheck()
        page.get_by_label("reclaim what the audit finds").check()
        page.get_by_role("button", name="Run audit now").click()
        # a worker computes it (the web's account may not list on Kubernetes): the page
        # says so and reloads until the result is in
        expect(page.locator("#audit-pending, #latest-audit").first).to_be_visible()
        expect(page.locator("#terms tr[data-term=leaked] td").nth(1)).to_have_text("1")
        expect(page.locator("#audit-pending")).to_have_count(0)
        expect(page.locator("#leaked")).to_contain_text(str(leaked.id))
        expect(page.locator("#residual")).to_contain_text("process")
        expect(page.locator("#residual")).to_contain_text("netns")
        expect(page.locator("#terms tr[data-term=reclaimed] td").nth(1)).to_have_text("1")
        expect(page.locator("#reclaims")).to_contain_text(leaked.external_id)
        screenshot(page, "leak-report")

        page.get_by_label("reclaim what the audit finds").uncheck()
        page.get_by_role("button", name="Run audit now").click()
        expect(page.locator("#history .history-row")).to_have_count(2)
        expect(page.locator("#terms tr[data-term=leaked] td").nth(1)).to_have_text("0")
        expect(page.locator("#equation")).to_contain_text("balanced")
        report = page.request.get(live.url + "/reports/leaks.json").json()
    assert [r["leaked"] for r in report["results"]] == [0, 1]
    asked = AuditRun.objects.filter(tenant=None, trigger="manual").order_by("created_at")
    assert [(r.status, r.reclaimed) for r in asked] == [("done", 1), ("done", 0)]
    assert report["reconcile_rounds"][0]["skipped"] is False
    assert SandboxEvent.objects.filter(sandbox=leaked, event="leak_reclaimed").count() == 1
    assert not [i for i in get_backend().inventory() if i.sandbox_id == leaked.id.hex]
    # Django's own admin sign-in page asks for /favicon.ico; our pages must add nothing.
    assert _unexpected(console.errors, refused=("/reports/leaks", "/sandboxes/")) == []


def test_it_shows_a_team_only_its_own_audit_history(live: Any, make_tenant: Any) -> None:
    mine, _ = make_tenant()
    theirs, _ = make_tenant()
    since = timezone.now()
    hidden = _ended_with_resources(theirs)
    audit_run(period_start=since, audit_slice=AuditSlice(tenant=mine))
    audit_run(period_start=since, audit_slice=AuditSlice(tenant=mine))
    audit_run(period_start=since, audit_slice=AuditSlice(tenant=theirs))
    alice = User.objects.create_user("alice", password="alice")
    membership_set_role(tenant=mine, user=alice, role="member")
    console = Console()
    with chromium() as browser:
        page = new_page(browser, live.url, console)
        sign_in(page, "alice", "alice")
        page.get_by_role("link", name="Leaks").click()
        page.wait_for_url("**/reports/leaks/mine")
        expect(page.locator("#history .history-row")).to_have_count(2)
        expect(page.locator("#terms tr[data-term=leaked] td").nth(1)).to_have_text("0")
        expect(page.locator("body")).not_to_contain_text(str(hidden.id))
        screenshot(page, "tenant-leaks")
        # The staff report is not for team members.
        page.goto("/reports/leaks")
        expect(page.locator("#staff-only")).to_be_visible()
    assert AuditRun.objects.filter(tenant=theirs).get().leaked == 1
    assert _unexpected(console.errors, refused=("/reports/leaks",)) == []
