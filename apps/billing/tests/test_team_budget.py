"""A hard monthly budget a team's owners set themselves (issue 24, "budget and alert
thresholds editable by owners"), on the Usage page and through ``/api/v1/budget``:
owners and admins may, members, viewers and other teams may not; bad amounts are typed
refusals that change nothing; once month-to-date spend reaches it, new creates are
refused with ``budget_exhausted`` naming ``team_budget`` while running sandboxes are
left alone."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import book, ledger_sandbox  # noqa: F401 - fixture
from apps.sandboxes.models import Sandbox, State
from apps.tenancy.models import Action, Activity
from apps.tenancy.services import api_key_create, membership_set_role

pytestmark = pytest.mark.django_db
PAGE_URL = "/billing/usage/budget"
API_URL = "/api/v1/budget"


def _client(tenant, name: str, role: str) -> Client:
    user = User.objects.create_user(name, password="pw")
    membership_set_role(tenant=tenant, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def _quota(tenant):
    return quota_get(tenant=tenant)


def _spend_an_hour(tenant) -> None:
    """An hour of 2 vCPU + 4 GiB this month: $0.29 with the test price book."""
    ledger_sandbox(
        tenant, timezone.now() - timedelta(hours=2), [("provisioning", 0), ("deleted", 3600)]
    )


def test_an_owner_sets_and_clears_the_team_budget_on_the_page(make_tenant):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    owner = _client(tenant, "olga", "owner")
    response = owner.post(PAGE_URL, {"team_budget": "$2,000"})
    assert response.status_code == 302 and response["Location"] == "/billing/usage/"
    assert _quota(tenant).team_budget == Decimal("2000.00")
    assert _quota(other).team_budget is None
    page = owner.get("/billing/usage/").content.decode()
    assert "Team budget set at $2,000.00 a month." in page
    assert 'id="team-budget-amount">$2,000.00<' in page and 'value="2000.00"' in page
    entry = Activity.objects.get(tenant=tenant, action=Action.QUOTA_CHANGED)
    assert entry.actor == "user:olga"
    assert entry.details == {"team_budget": {"old": None, "new": "2000.00"}}

    assert owner.post(PAGE_URL, {"team_budget": ""}).status_code == 302
    assert _quota(tenant).team_budget is None
    assert "The team has set no budget of its own." in owner.get("/billing/usage/").content.decode()


@pytest.mark.parametrize("bad", ["ten", "0", "-1", "2.001", "1e10", "NaN"])
def test_a_bad_budget_is_refused_by_the_field_and_changes_nothing(make_tenant, bad):
    tenant, _ = make_tenant()
    owner = _client(tenant, "omar", "owner")
    assert owner.post(PAGE_URL, {"team_budget": "75"}).status_code == 302
    before = Activity.objects.filter(tenant=tenant).count()
    response = owner.post(PAGE_URL, {"team_budget": bad})
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="e-team-budget">Enter an amount in dollars' in html
    assert 'aria-invalid="true"' in html and f'value="{bad}"' in html
    assert _quota(tenant).team_budget == Decimal("75.00")
    assert Activity.objects.filter(tenant=tenant).count() == before


def test_members_and_viewers_may_not_set_it_admins_may(make_tenant):
    tenant, _ = make_tenant()
    for role in ("member", "viewer"):
        client = _client(tenant, f"b-{role}", role)
        assert client.post(PAGE_URL, {"team_budget": "5"}).status_code == 403
        assert f'action="{PAGE_URL}"' not in client.get("/billing/usage/").content.decode()
    assert _quota(tenant).team_budget is None
    assert (
        _client(tenant, "b-admin", "admin").post(PAGE_URL, {"team_budget": "5"}).status_code == 302
    )
    assert _quota(tenant).team_budget == Decimal("5.00")


def test_the_api_reads_for_every_key_and_writes_only_with_admin_scope(make_tenant, api_client):
    tenant, admin_secret = make_tenant()
    other, other_secret = make_tenant()
    member_secret = api_key_create(tenant=tenant, name="ci", scopes=["read", "write"]).secret
    admin, member = api_client(admin_secret), api_client(member_secret)

    refused = member.patch(API_URL, {"team_budget": "9"}, format="json")
    assert refused.status_code == 403 and _quota(tenant).team_budget is None

    done = admin.patch(
        API_URL,
        {
            "team_budget": "120.50",
            "budget_alert": "100",
            "alert_webhook_url": "https://h.example/t0k3n",
        },
        format="json",
    )
    assert done.status_code == 200, done.content
    body = done.json()
    assert (body["team_budget"], body["budget_alert"]) == ("120.50", "100.00")
    assert body["alert_webhook_set"] is True and "t0k3n" not in done.content.decode()
    assert member.get(API_URL).json()["team_budget"] == "120.50"
    # the webhook is in the activity log only as "set"
    entry = Activity.objects.filter(tenant=tenant, action=Action.QUOTA_CHANGED).get()
    assert entry.details["alert_webhook_url"] == {"old": None, "new": "set"}
    assert "t0k3n" not in str(entry.details)

    # another team's key reads and writes its own team only
    theirs = api_client(other_secret)
    assert theirs.get(API_URL).json()["team_budget"] is None
    assert theirs.patch(API_URL, {"team_budget": "1"}, format="json").status_code == 200
    assert _quota(tenant).team_budget == Decimal("120.50")
    assert _quota(other).team_budget == Decimal("1.00")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"team_budget": "50", "budget_alert": "-1"}, "budget_alert"),
        ({"budget_alert": "5", "team_budget": "x"}, "team_budget"),
        ({"team_budget": "50", "alert_webhook_url": "ftp://h.example/"}, "alert_webhook_url"),
        ({"team_budget": "50", "monthly_budget": "1000"}, "monthly_budget"),
        ({"team_budget": ["50"]}, "team_budget"),
    ],
)
def test_one_bad_field_is_a_400_naming_it_and_nothing_changes(
    make_tenant, api_client, payload, field
):
    tenant, secret = make_tenant()
    before = Activity.objects.filter(tenant=tenant).count()
    response = api_client(secret).patch(API_URL, payload, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("validation_error", field)
    quota = _quota(tenant)
    assert (quota.team_budget, quota.budget_alert, quota.monthly_budget) == (None, None, None)
    assert quota.alert_webhook_url == ""
    assert Activity.objects.filter(tenant=tenant).count() == before


def test_at_the_budget_new_creates_are_refused_and_running_ones_untouched(
    make_tenant,
    api_client,
    no_enqueue,
    book,  # noqa: F811
):
    tenant, secret = make_tenant()
    http = api_client(secret)
    running = http.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert running.status_code == 201
    assert http.patch(API_URL, {"team_budget": "0.25"}, format="json").status_code == 200
    _spend_an_hour(tenant)  # $0.29 this month: over the team's $0.25

    refused = http.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert (error["code"], error["limit"], error["value"]) == (
        "budget_exhausted",
        "team_budget",
        "0.25",
    )
    assert Decimal(error["current"]) >= Decimal("0.29")
    assert "its owners set" in error["message"]
    queued = http.post("/api/v1/sandboxes", {"image": "host", "queue": True}, format="json")
    assert queued.status_code == 403 and queued.json()["error"]["limit"] == "team_budget"
    # nothing half-created, and the running sandbox is as it was
    assert Sandbox.objects.filter(tenant=tenant).count() == 2  # the running + the ledger one
    assert Sandbox.objects.get(external_id=running.json()["id"]).state == State.REQUESTED

    # raising it lets creates through again
    assert http.patch(API_URL, {"team_budget": "10"}, format="json").status_code == 200
    assert http.post("/api/v1/sandboxes", {"image": "host"}, format="json").status_code == 201


def test_the_usage_page_says_when_the_team_budget_is_spent(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    _spend_an_hour(tenant)
    owner = _client(tenant, "tara", "owner")
    owner.post(PAGE_URL, {"team_budget": "100"})
    assert 'id="team-budget-reached"' not in owner.get("/billing/usage/").content.decode()
    owner.post(PAGE_URL, {"team_budget": "0.25"})
    page = owner.get("/billing/usage/").content.decode()
    assert 'id="team-budget-reached"' in page and "new sandboxes are refused" in page
