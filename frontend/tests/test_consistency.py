"""Issue 24, defect 11: the same quantity reads the same everywhere. Hours for people
have two decimals (never "0.00" for a few seconds); money has one rule on every page
(cents, "<$0.01" under a cent); costs by label are not all $0.00; the class chart
colours task failures and undetermined apart from success; lifecycle times carry
seconds; the empty state names ``create_sandbox``; a deleted sandbox shows what it
cost, not a "cost so far" or a last heartbeat."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.test import Client

from apps.billing.models import PriceBook, PriceRate
from apps.billing.tests.test_costs import T0, ledger_sandbox
from apps.sandboxes.models import State
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode
from frontend.templatetags.hedgerow import hours, localtime_tag, money

pytestmark = pytest.mark.django_db


def test_hours_read_with_two_decimals_and_tiny_ones_are_not_zero():
    assert hours("1.2549") == "1.25"
    assert hours(Decimal("0.0028")) == "<0.01"
    assert hours("0.0000") == "0"
    assert hours("1234.5") == "1,234.50"
    assert hours(None) == "—"


def test_lifecycle_times_carry_seconds():
    tag = localtime_tag("2026-12-02T15:04:05+00:00", seconds=True)
    assert 'data-local="seconds"' in tag and "15:04:05 UTC" in tag


def test_a_deleted_sandbox_shows_its_cost_not_a_cost_so_far_or_heartbeat(make_tenant, make_user):
    tenant, _ = make_tenant()
    live = make_sandbox(tenant)
    gone = make_sandbox(tenant, state=State.DELETED)
    make_user("cviewer", (tenant, "viewer"))
    client = Client()
    assert client.login(username="cviewer", password="cviewer")
    shown = client.get(f"/sandboxes/{live.external_id}/header").content.decode()
    assert "Cost so far" in shown and "Last heartbeat" in shown
    ended = client.get(f"/sandboxes/{gone.external_id}/header").content.decode()
    assert "Cost so far" not in ended and "Last heartbeat" not in ended
    assert "<dt>Cost</dt>" in ended


def test_money_reads_with_one_rule():
    assert money(Decimal("0.29")) == "$0.29"
    assert money("1234.5") == "$1,234.50"
    assert money("0.125") == "$0.13"  # half up, as pricing.money rounds invoices
    assert money(Decimal("0")) == "$0.00"
    assert money(None) == "—"
    # under a cent: never "$0.00" nor "$0.000002"; the exact amount in the tooltip
    assert money(Decimal("0.000002")) == '<span title="$0.000002">&lt;$0.01</span>'
    assert money("-0.004") == '<span title="-$0.004">-&lt;$0.01</span>'


def _signed_in(make_user, tenant, name: str) -> Client:
    make_user(name, (tenant, "viewer"))
    client = Client()
    assert client.login(username=name, password=name)
    return client


def test_costs_by_label_are_not_rounded_away(make_tenant, make_user):
    """A labelled one-minute sandbox costs a fraction of a cent: the by-label table and
    chart used the report's cents, so every label read $0.00 and every bar was empty."""
    book = PriceBook.objects.create(
        slug="tiny", name="tiny", version=9, effective_from=datetime(2026, 3, 1, tzinfo=UTC)
    )
    PriceRate.objects.create(
        price_book=book,
        capacity_type="on_demand",
        vcpu_hour=Decimal("0.01"),
        gib_hour=Decimal("0.001"),
        startup_fee=Decimal("0"),
    )
    tenant, _ = make_tenant()
    ledger_sandbox(
        tenant,
        T0,
        [("provisioning", 0), ("deleted", 60)],
        cpu_millis=1000,
        memory_mib=1024,
        labels={"exp": "rl-1"},
    )
    client = _signed_in(make_user, tenant, "labelviewer")
    page = client.get("/billing/usage/", {"start": "2026-03-10", "end": "2026-03-10"})
    report = page.context["report"]
    assert report["by_label"][0]["cost"] == "0.00"  # the API's cents
    assert report["by_label"][0]["cost_exact"] == "0.000183"  # 60 s × $0.011/h
    assert page.context["label_chart"]["datasets"][0]["data"] == [0.000183]
    html = page.content.decode()
    by_label = html.split('id="by-label"')[1].split("</table>")[0]
    assert "exp=rl-1" in by_label
    assert '<td class="num"><span title="$0.000183">&lt;$0.01</span></td>' in by_label
    assert '<td class="num">$0.00</td>' not in by_label


def test_task_failures_and_undetermined_are_not_coloured_as_success(make_tenant, make_user):
    tenant, _ = make_tenant()
    now = datetime.now(tz=UTC)
    for cls in ("success", "task", "undetermined", "startup"):
        Episode.objects.create(
            tenant=tenant,
            task_id="t",
            status="closed",
            started_at=now,
            ended_at=now,
            auto_failure_class=cls,
            failure_class=cls,
            cost=Decimal("0.000002"),
        )
    client = _signed_in(make_user, tenant, "chartviewer")
    html = client.get("/trajectories/").content.decode()
    bars = {
        cls: html.split(f'data-class="{cls}"')[0].rsplit('<div class="', 1)[1]
        for cls in ("success", "task", "undetermined", "startup")
    }
    assert bars == {
        "success": 'bar" style="width: 100.0%" ',
        "task": 'bar failed" style="width: 100.0%" ',
        "undetermined": 'bar neutral" style="width: 100.0%" ',
        "startup": 'bar invalid" style="width: 100.0%" ',
    }
    assert "$0.000002" not in html.replace('title="$0.000002"', "")  # episode costs: one rule
    assert "&lt;$0.01" in html


def test_the_empty_sandbox_list_names_the_sdks_real_method(make_tenant, make_user):
    tenant, _ = make_tenant()
    make_user("emptywriter", (tenant, "member"))
    client = Client()
    assert client.login(username="emptywriter", password="emptywriter")
    html = client.get("/sandboxes/table").content.decode()
    assert "hedgerow.Client().create_sandbox()" in html
    assert "Client().create()" not in html
