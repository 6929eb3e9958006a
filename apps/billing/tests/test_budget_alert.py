"""A spending alert the team's owners set on the Usage page (issue 24, "budget and alert
thresholds editable by owners"): staff's monthly budget stays the hard cap; the alert
is the team's own warning. Post/redirect/get, typed refusals that change nothing,
admin scope enforced on the server, the change in the activity log, and no other team
touched."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import book, ledger_sandbox  # noqa: F401 - fixture
from apps.tenancy.models import Action, Activity
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db
URL = "/billing/usage/alert"


def _client(tenant, name: str, role: str) -> Client:
    user = User.objects.create_user(name, password="pw")
    membership_set_role(tenant=tenant, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def _alert(tenant):
    return quota_get(tenant=tenant).budget_alert


def test_an_owner_sets_and_clears_the_alert_with_a_redirect(make_tenant):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    owner = _client(tenant, "olive", "owner")
    response = owner.post(URL, {"budget_alert": "$1,250.50"})
    assert response.status_code == 302 and response["Location"] == "/billing/usage/"
    assert _alert(tenant) == Decimal("1250.50") and _alert(other) is None
    page = owner.get("/billing/usage/").content.decode()
    assert "Spending alert set at $1,250.50 a month." in page
    assert 'id="alert-amount">$1,250.50<' in page and 'value="1250.50"' in page
    entry = Activity.objects.get(tenant=tenant, action=Action.QUOTA_CHANGED)
    assert entry.actor == "user:olive"
    assert entry.details == {"budget_alert": {"old": None, "new": "1250.50"}}
    assert not Activity.objects.filter(tenant=other, action=Action.QUOTA_CHANGED).exists()

    assert owner.post(URL, {"budget_alert": " "}).status_code == 302
    assert _alert(tenant) is None
    assert "No spending alert is set." in owner.get("/billing/usage/").content.decode()


@pytest.mark.parametrize("bad", ["abc", "0", "-3", "1.005", "1e12", "NaN", "Infinity"])
def test_a_bad_amount_is_refused_by_the_field_and_changes_nothing(make_tenant, bad):
    tenant, _ = make_tenant()
    owner = _client(tenant, "owen", "owner")
    assert owner.post(URL, {"budget_alert": "40"}).status_code == 302
    before = Activity.objects.filter(tenant=tenant).count()
    response = owner.post(URL, {"budget_alert": bad})
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="e-budget-alert">Enter an amount in dollars' in html
    assert 'aria-invalid="true"' in html and f'value="{bad}"' in html
    assert _alert(tenant) == Decimal("40.00")
    assert Activity.objects.filter(tenant=tenant).count() == before


def test_only_owners_and_admins_may_set_it(make_tenant):
    tenant, _ = make_tenant()
    for role in ("member", "viewer"):
        client = _client(tenant, f"u-{role}", role)
        assert client.post(URL, {"budget_alert": "5"}).status_code == 403
        assert 'action="/billing/usage/alert"' not in client.get("/billing/usage/").content.decode()
    assert _alert(tenant) is None
    admin = _client(tenant, "u-admin", "admin")
    assert admin.post(URL, {"budget_alert": "5"}).status_code == 302
    assert _alert(tenant) == Decimal("5.00")


def test_the_page_says_when_this_months_spend_reached_it(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    # an hour of 2 vCPU + 4 GiB this month: $0.29 with the test price book
    ledger_sandbox(
        tenant, timezone.now() - timedelta(hours=2), [("provisioning", 0), ("deleted", 3600)]
    )
    owner = _client(tenant, "rita", "owner")
    owner.post(URL, {"budget_alert": "100"})
    assert 'id="alert-reached"' not in owner.get("/billing/usage/").content.decode()
    owner.post(URL, {"budget_alert": "0.25"})
    page = owner.get("/billing/usage/").content.decode()
    assert 'id="alert-reached"' in page
    assert "has reached the team&#x27;s alert at $0.25" in page or (
        "has reached the team's alert at $0.25" in page
    )
