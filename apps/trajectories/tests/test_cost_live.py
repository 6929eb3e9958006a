"""Issue 22 item 8: an episode costs the full cost of the sandbox it used (startup fee
and the time before it opened included), split between the episodes that shared it,
plus what the client reports."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from hedgerow import Client

from apps.sandboxes.metering.usage import sandbox_cost
from apps.sandboxes.models import Sandbox, State
from apps.trajectories.models import Episode
from apps.trajectories.selectors import episode_list, episode_stats
from apps.trajectories.services.episodes import episode_attribute

pytestmark = pytest.mark.timeout(180)


def _settle(sandbox_id: str) -> Sandbox:
    deadline = time.monotonic() + 60
    row = Sandbox.objects.get(external_id=sandbox_id)
    while row.state != State.DELETED and time.monotonic() < deadline:
        time.sleep(0.2)
        row.refresh_from_db()
    assert row.state == State.DELETED
    return row


def test_an_episode_costs_its_share_of_the_whole_sandbox_plus_client_cost(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(url=live.url, api_key=secret, max_retries=1, timeout=90) as hr:
        sandbox = hr.create_sandbox()
        with sandbox.episode(task_id="a") as first:
            sandbox.exec("echo one")
            first.verify("true", timeout=10)
        with sandbox.episode(task_id="b") as second:
            sandbox.exec("echo two")
            second.verify("false", timeout=10)
            second.set_result(client_cost="0.25")
        sandbox.delete()
    row = _settle(sandbox.id)
    full = sandbox_cost(sandbox=row)
    assert full is not None and full > 0
    half = (full / 2).quantize(Decimal("0.000001"))
    # The numbers compute it now: the whole sandbox (startup fee, time before and after
    # the episodes) plus the client's cost.
    stats = episode_stats(episodes=episode_list(tenant=tenant))
    assert stats.cost == (full + Decimal("0.25")).quantize(Decimal("0.000001"))
    assert stats.cost_per_valid == (stats.cost / 2).quantize(Decimal("0.000001"))
    # Re-attribution stores each episode's final share (and re-costs its sharers).
    episode_attribute(episode=Episode.objects.get(episode_id=first.id))
    first_row = Episode.objects.get(episode_id=first.id)
    second_row = Episode.objects.get(episode_id=second.id)
    assert first_row.cost == half
    assert (second_row.cost, second_row.client_cost) == (half + Decimal("0.25"), Decimal("0.25"))
    assert second_row.cost_basis == [
        {
            "sandbox_id": sandbox.id,
            "sandbox_cost": str(full.quantize(Decimal("0.000001"))),
            "episodes": 2,
            "share": str(half),
        }
    ]
