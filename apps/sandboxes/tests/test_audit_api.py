"""The audits API (tenant-scoped) and the /metrics and leak-report access rules."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.sandboxes import tasks
from apps.sandboxes.models import AuditRun, SandboxEvent, State
from apps.sandboxes.services import audit, reconcile
from apps.sandboxes.services.audit import audit_fill
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def _deleted(tenant: Any, external_id: str) -> None:
    sandbox = make_sandbox(tenant, state=State.DELETED, external_id=external_id)
    SandboxEvent.objects.create(
        sandbox=sandbox, tenant=tenant, event="created", to_state=State.REQUESTED
    )
    for to_state, reason in ((State.TERMINATING, "deleted"), (State.DELETED, "destroyed")):
        SandboxEvent.objects.create(
            sandbox=sandbox, tenant=tenant, event="transition", to_state=to_state, reason=reason
        )


def _post_audit(api: Any, monkeypatch: pytest.MonkeyPatch, capture: Any) -> Any:
    """POST /api/v1/audits; returns the response after running the enqueued task the
    way the worker would (its on-commit enqueue recorded, then ``audit_fill``)."""
    enqueued: list[int] = []
    monkeypatch.setattr(tasks.run_audit, "delay", enqueued.append)
    with capture(execute=True):
        response = api.post("/api/v1/audits", {}, format="json")
    for run_id in enqueued:
        audit_fill(run_id)
    return response


def test_it_audits_the_callers_tenant_only_and_keeps_its_history(
    make_tenant: Any,
    api_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    mine, secret = make_tenant()
    theirs, their_secret = make_tenant()
    _deleted(mine, "sb-mine")
    _deleted(theirs, "sb-theirs-1")
    _deleted(theirs, "sb-theirs-2")

    capture = django_capture_on_commit_callbacks
    ran = _post_audit(api_client(secret), monkeypatch, capture)
    _post_audit(api_client(their_secret), monkeypatch, capture)

    assert ran.status_code == 202, ran.content
    assert ran.json()["status"] == "running"
    assert ran["Location"] == f"/api/v1/audits/{ran.json()['id']}"
    body = api_client(secret).get(ran["Location"]).json()
    assert body["status"] == "done"
    assert (body["created"], body["deleted"], body["leaked"], body["balanced"]) == (1, 1, 0, True)
    assert body["tenant"] == mine.slug
    assert AuditRun.objects.get(pk=body["id"]).tenant == mine
    history = api_client(secret).get("/api/v1/audits").json()["results"]
    assert [run["id"] for run in history] == [body["id"]]
    assert all(run["tenant"] == mine.slug for run in history)
    # another team's audit is not found, not forbidden
    assert api_client(their_secret).get(ran["Location"]).status_code == 404


def test_it_never_lists_the_backend_in_the_web_request(
    make_tenant: Any, api_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, secret = make_tenant()

    def no_inventory() -> None:
        raise AssertionError("the web process listed the backend")

    monkeypatch.setattr(audit, "get_backend", no_inventory)
    monkeypatch.setattr(reconcile, "get_backend", no_inventory)
    response = api_client(secret).post("/api/v1/audits", {}, format="json")
    assert response.status_code == 202, response.content
    assert AuditRun.objects.get(pk=response.json()["id"]).status == "running"


def test_it_runs_one_audit_at_a_time_per_team_and_throttles_them(
    make_tenant: Any,
    api_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
    settings: Any,
) -> None:
    settings.HEDGEROW_AUDIT_MIN_INTERVAL_S = 600
    _, secret = make_tenant()
    _, other = make_tenant()
    enqueued: list[int] = []
    monkeypatch.setattr(tasks.run_audit, "delay", enqueued.append)
    first = api_client(secret).post("/api/v1/audits", {}, format="json")
    assert first.status_code == 202
    busy = api_client(secret).post("/api/v1/audits", {}, format="json")
    assert busy.status_code == 429
    assert busy.json()["error"]["code"] == "audit_in_progress"
    assert busy.json()["error"]["audit_id"] == first.json()["id"]
    assert int(busy["Retry-After"]) >= 1
    audit_fill(first.json()["id"])
    again = api_client(secret).post("/api/v1/audits", {}, format="json")
    assert again.status_code == 429
    assert again.json()["error"]["code"] == "audit_throttled"
    assert 1 <= int(again["Retry-After"]) <= 600
    # throttled per team: another team is not held back
    assert api_client(other).post("/api/v1/audits", {}, format="json").status_code == 202
    assert AuditRun.objects.filter(trigger="manual").count() == 2


def test_it_refuses_a_malformed_period(make_tenant: Any, api_client: Any) -> None:
    _, secret = make_tenant()
    response = api_client(secret).post(
        "/api/v1/audits", {"period_start": "yesterday"}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "period_start"
    assert AuditRun.objects.count() == 0


def test_it_needs_a_key_with_write_scope_to_run_an_audit(make_tenant: Any, api_client: Any) -> None:
    _, secret = make_tenant(scopes=["read"])
    assert api_client(secret).post("/api/v1/audits", {}, format="json").status_code == 403
    assert api_client(secret).get("/api/v1/audits").status_code == 200
    assert AuditRun.objects.count() == 0


def test_it_serves_metrics_to_staff_and_the_token_only(settings: Any, make_tenant: Any) -> None:
    settings.HEDGEROW_METRICS_TOKEN = "scrape-me"
    tenant, _ = make_tenant()
    _deleted(tenant, "sb-counted")
    client = Client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    member = User.objects.create_user("member", password="x")
    client.force_login(member)
    assert client.get("/metrics").status_code == 401
    assert client.get("/reports/leaks").status_code == 403  # signed in, not staff
    assert client.get("/reports/leaks.json").status_code == 403

    by_token = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me")
    staff = User.objects.create_user("ops", password="x", is_staff=True)
    client.force_login(staff)
    by_staff = client.get("/metrics")

    for response in (by_token, by_staff):
        assert response.status_code == 200
        line = f'hedgerow_sandboxes{{state="deleted",tenant="{tenant.slug}"}} 1.0'
        assert line in response.content.decode()
    assert client.get("/reports/leaks.json").json()["results"] == []


def test_staffs_audit_now_runs_in_a_worker_and_the_page_shows_it_pending_then_done(
    make_tenant: Any, monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    tenant, _ = make_tenant()
    _deleted(tenant, "sb-counted")
    client = Client()
    client.force_login(User.objects.create_user("ops", password="x", is_staff=True))
    enqueued: list[int] = []
    monkeypatch.setattr(tasks.run_audit, "delay", enqueued.append)
    rounds: list[str] = []
    monkeypatch.setattr(audit, "sandbox_reconcile", lambda: rounds.append("round"))

    def no_inventory() -> None:
        raise AssertionError("the web process listed the backend")

    with monkeypatch.context() as web:  # the web's account may not list (Kubernetes)
        web.setattr(audit, "get_backend", no_inventory)
        web.setattr(reconcile, "get_backend", no_inventory)
        with django_capture_on_commit_callbacks(execute=True):
            posted = client.post("/reports/leaks/run", {"reconcile": "1", "reclaim": "1"})
        assert posted.status_code == 302
        (run,) = AuditRun.objects.filter(tenant=None)
        assert run.status == "running" and enqueued == [run.pk] and rounds == []
        assert run.report == {"requested": {"reconcile": True, "reclaim": True}}
        page = client.get("/reports/leaks").content.decode()
        assert 'id="audit-pending"' in page and 'http-equiv="refresh"' in page
        assert 'id="no-audit"' in page  # no result yet
        with django_capture_on_commit_callbacks(execute=True):  # asked again: the same one
            client.post("/reports/leaks/run", {"reclaim": "1"})
        assert enqueued == [run.pk] and AuditRun.objects.filter(tenant=None).count() == 1

    audit_fill(run.pk)  # the worker's half
    run.refresh_from_db()
    assert run.status == "done" and run.created == 1 and run.deleted == 1 and run.balanced
    assert rounds == ["round"]  # reconciled first, in the worker
    page = client.get("/reports/leaks").content.decode()
    assert 'id="audit-pending"' not in page and 'http-equiv="refresh"' not in page
    assert 'id="latest-audit"' in page and "balanced" in page
    assert [r["status"] for r in client.get("/reports/leaks.json").json()["results"]] == ["done"]


def test_a_failed_staff_audit_says_why_on_the_page(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    client = Client()
    client.force_login(User.objects.create_user("ops", password="x", is_staff=True))
    enqueued: list[int] = []
    monkeypatch.setattr(tasks.run_audit, "delay", enqueued.append)
    with django_capture_on_commit_callbacks(execute=True):
        client.post("/reports/leaks/run", {})

    def broken() -> None:
        raise RuntimeError("forbidden: cannot list pods")

    monkeypatch.setattr(audit, "audit_compute", lambda **_: broken())
    with pytest.raises(RuntimeError):
        audit_fill(enqueued[0])
    page = client.get("/reports/leaks").content.decode()
    assert 'id="audit-failed"' in page and "forbidden: cannot list pods" in page
    assert 'id="audit-pending"' not in page
