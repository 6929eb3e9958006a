"""Peak concurrency per day on the Usage page (issue 24, "What a team expects": a
concurrency-over-time chart), from the usage ledger written by real lifecycle events."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.billing.reports import peak_concurrency
from apps.billing.tests.test_costs import T0, book, ledger_sandbox  # noqa: F401 - fixture
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db
START = datetime(2026, 3, 9, tzinfo=UTC)
END = datetime(2026, 3, 13, tzinfo=UTC)  # the 9th to the 12th


def _held(tenant, at, seconds, **kw):
    return ledger_sandbox(tenant, at, [("provisioning", 0), ("deleted", seconds)], **kw)


def test_it_counts_the_most_sandboxes_held_at_once_each_day(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    # 10th, from 10:00: three overlap 10:30–11:00; a fourth starts exactly as one ends
    _held(tenant, T0, 3600)  # 10:00–11:00
    _held(tenant, T0 + timedelta(minutes=15), 3600)  # 10:15–11:15
    _held(tenant, T0 + timedelta(minutes=30), 1800)  # 10:30–11:00
    _held(tenant, T0 + timedelta(hours=1), 600)  # 11:00–11:10: never a fourth at once
    # one across midnight into the 11th, alone there
    _held(tenant, T0 + timedelta(hours=13), 7200)  # 23:00 – 01:00 on the 11th
    for _ in range(5):  # another team's sandboxes count for it, not here
        _held(other, T0, 3600)
    days = peak_concurrency(tenant=tenant, start=START, end=END)
    assert days == [
        {"day": "2026-03-09", "peak": 0},
        {"day": "2026-03-10", "peak": 3},
        {"day": "2026-03-11", "peak": 1},
        {"day": "2026-03-12", "peak": 0},
    ]
    assert [d["peak"] for d in peak_concurrency(tenant=other, start=START, end=END)] == [
        0,
        5,
        0,
        0,
    ]


def test_a_sandbox_ending_at_midnight_does_not_count_for_the_next_day(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    _held(tenant, datetime(2026, 3, 10, 23, tzinfo=UTC), 3600)  # ends 00:00 on the 11th
    _held(tenant, datetime(2026, 3, 11, 0, tzinfo=UTC), 60)  # starts 00:00 on the 11th
    peaks = [d["peak"] for d in peak_concurrency(tenant=tenant, start=START, end=END)]
    assert peaks == [0, 1, 1, 0]


def test_a_live_sandbox_counts_up_to_now(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    ledger_sandbox(tenant, T0, [("provisioning", 0), ("ready", 5)])  # never ended
    now = T0 + timedelta(days=1, hours=3)  # the 11th, 13:00
    peaks = peak_concurrency(tenant=tenant, start=START, end=END, now=now)
    assert [d["peak"] for d in peaks] == [0, 1, 1, 0]


def test_the_usage_page_charts_and_tabulates_it(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    _held(tenant, T0, 3600)
    _held(tenant, T0 + timedelta(minutes=5), 60)
    user = User.objects.create_user("conc", password="pw")
    membership_set_role(tenant=tenant, user=user, role="viewer")
    client = Client()
    client.force_login(user)
    html = client.get("/billing/usage/", {"start": "2026-03-09", "end": "2026-03-12"})
    text = html.content.decode()
    assert html.status_code == 200
    found = re.search(r'<script id="concurrency-data" type="application/json">(.*?)</script>', text)
    assert found is not None
    chart = json.loads(found.group(1))
    assert chart["labels"] == ["03-09", "03-10", "03-11", "03-12"]
    assert chart["datasets"][0]["data"] == [0, 2, 0, 0]
    rows = re.findall(r"<tr><td>(2026-03-\d\d)</td><td class=\"num\">(\d+)</td></tr>", text)
    assert ("2026-03-10", "2") in rows and ("2026-03-09", "0") in rows


def test_the_sweep_in_sql_equals_the_python_sweep(make_tenant, book):  # noqa: F811
    """``_peak_sweep`` (one statement, a row per day) against ``_peak_sweep_walk`` (every
    record's instants in Python): ties, midnight, a day with no instant held over, a
    live record, windows cut mid-day at either end."""
    from apps.billing.reports import _peak_sweep, _peak_sweep_walk

    tenant, _ = make_tenant()
    _held(tenant, datetime(2026, 3, 9, 22, tzinfo=UTC), 2 * 3600)  # ends 00:00 on the 10th
    _held(tenant, datetime(2026, 3, 10, 0, tzinfo=UTC), 60)  # starts as it ends
    _held(tenant, datetime(2026, 3, 10, 0, tzinfo=UTC), 60)  # tie: two at once
    _held(tenant, datetime(2026, 3, 10, 5, tzinfo=UTC), 2 * 86400)  # through the 11th, alone
    _held(tenant, datetime(2026, 3, 12, 4, 59, tzinfo=UTC), 60)  # overlaps its last minute
    ledger_sandbox(tenant, datetime(2026, 3, 12, 6, tzinfo=UTC), [("provisioning", 0)])  # live
    now = datetime(2026, 3, 12, 18, tzinfo=UTC)
    windows = [
        (START, END),
        (START + timedelta(hours=23), END - timedelta(hours=20)),
        (datetime(2026, 3, 10, 0, 0, 30, tzinfo=UTC), datetime(2026, 3, 12, 5, tzinfo=UTC)),
        (datetime(2026, 3, 11, tzinfo=UTC), datetime(2026, 3, 12, tzinfo=UTC)),
    ]
    for start, end in windows:
        sql = _peak_sweep(tenant=tenant, start=start, end=end, now=now)
        assert sql == _peak_sweep_walk(tenant=tenant, start=start, end=end, now=now), (start, end)
    assert [d["peak"] for d in _peak_sweep(tenant=tenant, start=START, end=END, now=now)] == [
        1,
        2,
        1,
        2,
    ]
    other, _ = make_tenant()  # no records: every day 0
    assert [d["peak"] for d in _peak_sweep(tenant=other, start=START, end=END)] == [0] * 4
