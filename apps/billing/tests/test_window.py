"""One window rule for usage and cost reports: a bare end date is inclusive, a single
day is a window, and the page, its sort links and its CSV use the same window."""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from apps.billing.api.usage_views import parse_window, window_end_date
from apps.billing.tests.test_costs import T0, book, ledger_sandbox  # noqa: F401 - fixture
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db


def test_a_bare_end_date_runs_through_the_end_of_that_day() -> None:
    start, end = parse_window({"start": "2026-03-10", "end": "2026-03-10"})
    assert start == datetime(2026, 3, 10, tzinfo=UTC)
    assert end == datetime(2026, 3, 11, tzinfo=UTC)
    assert window_end_date(end) == "2026-03-10"


def test_a_datetime_end_stays_an_exact_exclusive_bound() -> None:
    _, end = parse_window({"start": "2026-03-10", "end": "2026-03-10T12:00:00"})
    assert end == datetime(2026, 3, 10, 12, tzinfo=UTC)
    assert window_end_date(end) == "2026-03-10"


def test_the_usage_page_counts_today_when_today_is_the_end_date(
    make_tenant,
    client,
    book,  # noqa: F811
) -> None:
    tenant, _ = make_tenant()
    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    ledger_sandbox(tenant, midnight, [("provisioning", 0), ("deleted", 3600)])
    user = User.objects.create_user("ana", password="pw")
    membership_set_role(tenant=tenant, user=user, role="viewer")
    client.force_login(user)
    today = midnight.date().isoformat()
    page = client.get("/billing/usage/", {"start": today, "end": today})
    assert page.context["error"] == ""
    assert page.context["report"]["totals"]["cost"] == "0.29"  # 1 h × 0.24 + 0.05
    # the form shows the window it counted, so pressing Show again changes nothing
    assert page.context["start"] == today and page.context["end"] == today
    html = page.content.decode()
    assert f'name="end" type="date" value="{today}"' in html


def test_the_cost_report_its_sorting_and_its_csv_count_the_same_single_day(
    make_tenant,
    client,
    book,  # noqa: F811
) -> None:
    a, _ = make_tenant()
    b, _ = make_tenant()
    ledger_sandbox(a, T0, [("provisioning", 0), ("deleted", 7200)])
    ledger_sandbox(b, T0, [("provisioning", 0), ("deleted", 3600)])
    ledger_sandbox(b, T0 + timedelta(days=1), [("provisioning", 0), ("deleted", 3600)])
    staff = User.objects.create_user("root", password="pw", is_staff=True)
    client.force_login(staff)
    day = T0.date().isoformat()
    page = client.get("/billing/staff/costs/", {"start": day, "end": day, "sort": "cost"})
    assert page.context["error"] == ""
    rows = {r["tenant"]: str(r["cost"]) for r in page.context["rows"]}
    assert rows == {a.slug: "0.53", b.slug: "0.29"}  # b's second day is outside
    html = page.content.decode()
    csv_href = re.search(r'id="csv-link" href="([^"]+)"', html)
    sort_href = re.search(r'href="([^"]+)" data-sort="cost"', html)
    assert csv_href and sort_href
    for href in (csv_href.group(1), sort_href.group(1)):
        assert f"start={day}&amp;end={day}" in href
    export = client.get("/billing/staff/costs/" + csv_href.group(1).replace("&amp;", "&"))
    table = list(csv.DictReader(io.StringIO(export.content.decode())))
    assert {r["tenant"]: r["cost"] for r in table} == rows
    resorted = client.get("/billing/staff/costs/" + sort_href.group(1).replace("&amp;", "&"))
    assert {r["tenant"]: str(r["cost"]) for r in resorted.context["rows"]} == rows
