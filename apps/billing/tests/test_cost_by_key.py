"""Cost per API key on the Usage page (issue 24, "Usage: … cost per key"): sandboxes
are attributed by the key that created them (``created_by``), named by the team's own
key; the rows add up to the period's total; another team's usage and keys never show."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.billing.reports import cost_by_key, tenant_report
from apps.billing.tests.test_costs import T0, book, ledger_sandbox  # noqa: F401 - fixture
from apps.sandboxes.models import Sandbox
from apps.tenancy.models import ApiKey
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db
START = datetime(2026, 3, 1, tzinfo=UTC)
END = datetime(2026, 4, 1, tzinfo=UTC)


def _held(tenant, seconds: int, created_by: str):
    sandbox = ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", seconds)])
    Sandbox.objects.filter(pk=sandbox.pk).update(created_by=created_by)


def _key(tenant, prefix: str, name: str) -> None:
    ApiKey.objects.create(tenant=tenant, name=name, prefix=prefix, secret_hash=uuid.uuid4().hex * 2)


def test_it_splits_the_periods_cost_by_the_creating_key(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    _key(tenant, "ci000001", "ci-runner")
    _key(other, "gone0001", "other-teams-name")  # same prefix, another team
    _held(tenant, 3600, "key:ci000001")  # 2 vCPU, 4 GiB: $0.24/h + $0.05 start
    _held(tenant, 7200, "key:ci000001")
    _held(tenant, 3600, "key:gone0001")  # a key since deleted
    _held(tenant, 3600, "user:ana")  # the dashboard
    _held(other, 36000, "key:gone0001")
    rows = cost_by_key(tenant=tenant, start=START, end=END)
    assert [(r["key"], r["name"], r["sandboxes"], r["cost"]) for r in rows] == [
        ("ci000001", "ci-runner", 2, "0.82"),
        ("gone0001", "", 1, "0.29"),  # a tie: keys first, then the dashboard
        ("", "", 1, "0.29"),
    ]
    total = Decimal(tenant_report(tenant=tenant, start=START, end=END).as_dict()["totals"]["cost"])
    assert sum(Decimal(r["cost"]) for r in rows) == total == Decimal("1.40")

    user = User.objects.create_user("keycost", password="pw")
    membership_set_role(tenant=tenant, user=user, role="viewer")
    client = Client()
    client.force_login(user)
    html = client.get("/billing/usage/", {"start": "2026-03-01", "end": "2026-03-31"})
    text = html.content.decode()
    assert 'data-key="ci000001"><td>ci-runner <code>ci000001…</code>' in text
    assert 'data-key="gone0001"><td>(deleted key)' in text
    assert "dashboard and other" in text and "other-teams-name" not in text
