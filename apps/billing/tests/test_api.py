"""The HTTP surface: typed quota errors, queued creates, quota/usage endpoints, staff
quota edits and the cost report (JSON and CSV)."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import T0, book, ledger_sandbox  # noqa: F401 - fixture
from apps.sandboxes.models import Sandbox, State

pytestmark = pytest.mark.django_db


def _limit(tenant, **fields):
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(**fields)


def test_it_answers_429_with_retry_after_naming_the_limit(make_tenant, api_client, no_enqueue):
    tenant, secret = make_tenant()
    _limit(tenant, max_concurrent_sandboxes=1)
    http = api_client(secret)
    assert http.post("/api/v1/sandboxes", {"image": "host"}, format="json").status_code == 201
    refused = http.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "quota_exceeded"
    assert (error["limit"], error["value"], error["current"]) == ("max_concurrent_sandboxes", 1, 1)
    assert Sandbox.objects.filter(tenant=tenant).count() == 1


def test_it_queues_a_create_that_asks_to_wait_and_shows_its_position(
    make_tenant, api_client, no_enqueue
):
    tenant, secret = make_tenant()
    _limit(tenant, max_concurrent_sandboxes=1)
    http = api_client(secret)
    started = http.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert "Retry-After" not in started  # it starts at once: nothing to wait for
    first = started.json()
    assert first["queue_position"] is None and first["cost"] is None
    queued = http.post("/api/v1/sandboxes", {"image": "host", "queue": True}, format="json")
    assert queued.status_code == 201
    assert int(queued["Retry-After"]) >= 1  # when to look again (the admission sweep)
    body = queued.json()
    assert body["state"] == "queued" and body["queue_position"] == 1
    again = http.get(f"/api/v1/sandboxes/{body['id']}").json()
    assert again["queue_position"] == 1
    waited = http.get(f"/api/v1/sandboxes/{body['id']}/wait", {"timeout": 0})
    assert waited.status_code == 408 and waited.json()["error"]["state"] == "queued"
    assert int(waited["Retry-After"]) >= 1
    assert Sandbox.objects.get(external_id=body["id"]).state == State.QUEUED
    # A client that heartbeats while waiting is not refused.
    assert http.post(f"/api/v1/sandboxes/{body['id']}/heartbeat").status_code == 200
    assert len(no_enqueue["provision"]) == 0  # on_commit never fires inside a db test


def test_it_shows_quota_use_and_usage_only_for_the_callers_team(
    make_tenant,
    api_client,
    book,  # noqa: F811
):
    tenant, secret = make_tenant()
    outsider, outsider_secret = make_tenant()
    _limit(tenant, max_concurrent_sandboxes=7, monthly_budget=Decimal("100.00"))
    ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", 3600)], image="python")
    quota = api_client(secret).get("/api/v1/quota").json()
    assert quota["concurrent_sandboxes"] == {"limit": 7, "current": 0}
    assert quota["monthly_budget"]["limit"] == "100.00"
    window = {"start": "2026-03-10", "end": "2026-03-11"}
    usage = api_client(secret).get("/api/v1/usage", window).json()
    assert usage["totals"]["cost"] == "0.29"  # 1 h × 0.24 + 0.05
    assert usage["by_image"][0]["image"] == "python"
    assert {r["slug"] for r in usage["hosted_comparison"]} == {"e2b", "daytona", "modal"}
    other = api_client(outsider_secret).get("/api/v1/usage", window).json()
    assert other["totals"]["cost"] == "0.00" and other["by_image"] == []
    bad = api_client(secret).get("/api/v1/usage", {"start": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "start"


def test_it_lets_only_staff_edit_a_tenants_quota(make_tenant, api_client):
    tenant, secret = make_tenant()
    url = f"/api/v1/admin/tenants/{tenant.slug}/quota"
    assert api_client(secret).patch(url, {"max_concurrent_sandboxes": 1}).status_code in (401, 403)
    member = User.objects.create_user("member", password="pw")
    http = APIClient()
    http.force_login(member)
    assert http.patch(url, {"max_concurrent_sandboxes": 1}, format="json").status_code == 403
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    http.force_login(staff)
    changed = http.patch(
        url, {"max_concurrent_sandboxes": 3, "monthly_budget": "12.50"}, format="json"
    )
    assert changed.status_code == 200, changed.content
    quota = quota_get(tenant=tenant)
    assert (quota.max_concurrent_sandboxes, quota.monthly_budget) == (3, Decimal("12.50"))
    assert http.get("/api/v1/admin/tenants/nope/quota").status_code == 404


def test_it_reports_costs_of_all_tenants_sorted_and_as_csv(
    make_tenant,
    book,  # noqa: F811
):
    a, _ = make_tenant()
    b, _ = make_tenant()
    ledger_sandbox(a, T0, [("provisioning", 0), ("deleted", 7200)])  # 2 h × 0.24 + 0.05
    ledger_sandbox(b, T0, [("provisioning", 0), ("deleted", 3600)], cpu_millis=1000)
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    http = APIClient()
    http.force_login(staff)
    window = {"start": "2026-03-01", "end": "2026-04-01"}
    rows = http.get("/api/v1/admin/cost-report", {**window, "sort": "cost"}).json()["results"]
    assert [(r["tenant"], r["cost"]) for r in rows] == [(b.slug, "0.19"), (a.slug, "0.53")]
    response = http.get("/api/v1/admin/cost-report", {**window, "output": "csv"})
    assert response["Content-Type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert table[0]["tenant"] == a.slug and table[0]["cost"] == "0.53"
    assert table[0]["price_books"] == "hedgerow v2"


def test_it_lists_costs_and_queue_positions_without_a_query_per_sandbox(
    make_tenant,
    api_client,
    no_enqueue,
    book,  # noqa: F811
    django_assert_max_num_queries,
):
    tenant, secret = make_tenant()
    for _ in range(5):
        ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", 3600)])
    _limit(tenant, max_concurrent_sandboxes=0)
    http = api_client(secret)
    for _ in range(3):
        assert http.post("/api/v1/sandboxes", {"queue": True}, format="json").status_code == 201
    with django_assert_max_num_queries(8):
        listed = http.get("/api/v1/sandboxes").json()["results"]
    assert sorted(s["queue_position"] for s in listed if s["state"] == "queued") == [1, 2, 3]
    assert {s["cost"] for s in listed if s["state"] == "deleted"} == {"0.290000"}


def test_staff_set_a_tenants_egress_limits_validated_and_canonical(make_tenant):
    tenant, _ = make_tenant()
    url = f"/api/v1/admin/tenants/{tenant.slug}/quota"
    http = APIClient()
    http.force_login(User.objects.create_user("staff", password="pw", is_staff=True))
    bad = http.patch(url, {"egress_patterns": ["169.254.0.0/16:80"]}, format="json")
    assert bad.status_code == 400, bad.content
    assert bad.json()["error"]["field"] == "egress_patterns"
    changed = http.patch(
        url,
        {"egress_allow_all": False, "egress_patterns": ["*.Example.org", "10.0.0.0/8:443"]},
        format="json",
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["egress_patterns"] == ["*.example.org", "10.0.0.0/8:443"]
    quota = quota_get(tenant=tenant)
    assert (quota.egress_allow_all, quota.egress_patterns) == (
        False,
        ["*.example.org", "10.0.0.0/8:443"],
    )
