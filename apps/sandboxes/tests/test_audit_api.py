"""The audits API (tenant-scoped) and the /metrics and leak-report access rules."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.sandboxes.models import AuditRun, SandboxEvent, State
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


def test_it_audits_the_callers_tenant_only_and_keeps_its_history(
    make_tenant: Any, api_client: Any
) -> None:
    mine, secret = make_tenant()
    theirs, their_secret = make_tenant()
    _deleted(mine, "sb-mine")
    _deleted(theirs, "sb-theirs-1")
    _deleted(theirs, "sb-theirs-2")

    ran = api_client(secret).post("/api/v1/audits", {}, format="json")
    api_client(their_secret).post("/api/v1/audits", {}, format="json")

    assert ran.status_code == 201, ran.content
    body = ran.json()
    assert (body["created"], body["deleted"], body["leaked"], body["balanced"]) == (1, 1, 0, True)
    assert body["tenant"] == mine.slug
    assert AuditRun.objects.get(pk=body["id"]).tenant == mine
    history = api_client(secret).get("/api/v1/audits").json()["results"]
    assert [run["id"] for run in history] == [body["id"]]
    assert all(run["tenant"] == mine.slug for run in history)


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
