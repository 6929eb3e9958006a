"""Issue 24, defect 11: the same quantity reads the same everywhere. Hours for people
have two decimals (never "0.00" for a few seconds); lifecycle times carry seconds; a
deleted sandbox shows what it cost, not a "cost so far" or a last heartbeat."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client

from apps.sandboxes.models import State
from apps.sandboxes.tests.factories import make_sandbox
from frontend.templatetags.hedgerow import hours, localtime_tag

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
