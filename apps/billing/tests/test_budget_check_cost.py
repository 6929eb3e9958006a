"""The budget check on every create (issue 20: costs that grow with change, not size):
with a budget set, admission read every usage record of the month under the tenant's
quota row lock (``tenant_month_cost``), so a month of history slowed every create of the
team. It now reads the month as the pages do — finished days from the daily roll-up,
today's part from the records — and decides the same."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from apps.billing.errors import BudgetExhausted
from apps.billing.pricing import money
from apps.billing.quotas import check_budget, quota_get
from apps.billing.reports import daily_usage_rebuild, day_bounds
from apps.billing.tests.test_costs import book  # noqa: F401 (fixture)
from apps.billing.tests.test_usage_rollup_report import _closed, _history, _measured
from apps.billing.usage import month_start, tenant_month_cost

pytestmark = pytest.mark.django_db


@pytest.fixture
def mid_month(monkeypatch: pytest.MonkeyPatch) -> datetime:
    """A ``now`` with at least four finished days of its month behind it (in the first
    days of a month: the 20th of the month before), for every reader of the clock."""
    now = timezone.now().replace(microsecond=0)
    if now.day < 5:
        now -= timedelta(days=now.day + 10)
    monkeypatch.setattr(timezone, "now", lambda: now)
    return now


def test_the_budget_check_reads_the_same_at_100_and_2000_records_of_the_month(
    make_tenant,
    book,  # noqa: F811
    mid_month,
):
    tenant, _ = make_tenant()
    _history(tenant, mid_month)
    quota = quota_get(tenant=tenant)
    quota.team_budget = Decimal("1000000")
    quota.save(update_fields=["team_budget"])
    check_budget(quota=quota)  # warm: the price book and other per-process caches
    costs = []
    for n in (100, 1900):
        # this month's history, on a finished day
        _closed(tenant, n, day_bounds((mid_month - timedelta(days=3)).date())[0])
        assert day_bounds((mid_month - timedelta(days=3)).date())[0] >= month_start(mid_month)
        for k in range(1, 5):
            daily_usage_rebuild(day=(mid_month - timedelta(days=k)).date())
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE billing_usagerecord, billing_dailyusage, sandboxes_sandbox")
            cursor.execute("SET LOCAL enable_seqscan = off")
        costs.append(_measured(lambda: check_budget(quota=quota)))
    (rows_small, queries_small), (rows_big, queries_big) = costs
    assert queries_small == queries_big, costs
    assert rows_big <= 2 * rows_small and rows_big < 500, costs


def test_the_budget_check_refuses_at_the_month_to_date_spend(
    make_tenant,
    book,  # noqa: F811
    mid_month,
):
    tenant, _ = make_tenant()
    _history(tenant, mid_month)
    _closed(tenant, 50, day_bounds((mid_month - timedelta(days=2)).date())[0])
    for k in range(1, 5):
        daily_usage_rebuild(day=(mid_month - timedelta(days=k)).date())
    # the walk of every record: the figure the check must agree with
    spent = tenant_month_cost(tenant=tenant)
    assert spent > 0
    quota = quota_get(tenant=tenant)
    quota.team_budget = (spent + Decimal("0.01")).quantize(Decimal("0.01"))
    quota.save(update_fields=["team_budget"])
    check_budget(quota=quota)  # a cent left: admitted
    quota.team_budget = (spent - Decimal("0.01")).quantize(Decimal("0.01"))
    quota.save(update_fields=["team_budget"])
    with pytest.raises(BudgetExhausted) as refused:
        check_budget(quota=quota)
    detail: Any = refused.value
    assert detail.extra["limit"] == "team_budget"
    assert Decimal(detail.extra["current"]) == money(spent)
