"""Compare-and-set transitions under a race: a move that is still valid is retried,
never silently dropped."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import QuerySet

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services import lifecycle
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def test_it_still_deletes_when_provisioning_claims_the_row_mid_transition(make_tenant, monkeypatch):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    real_update = QuerySet.update
    raced = {"done": False}

    def update_after_a_race(self, **kwargs):
        # Between the delete's read and its update, the provisioner claims the row.
        if self.model is Sandbox and not raced["done"]:
            raced["done"] = True
            real_update(
                Sandbox.objects.filter(pk=sandbox.pk), state=State.PROVISIONING, generation=1
            )
        return real_update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", update_after_a_race)
    moved = lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED, State.PROVISIONING, State.READY),
        to_state=State.TERMINATING,
        reason="deleted",
    )
    assert raced["done"]
    assert moved is True
    sandbox.refresh_from_db()
    assert (sandbox.state, sandbox.generation) == (State.TERMINATING, 1)
    event = SandboxEvent.objects.get(sandbox=sandbox, event="transition")
    assert (event.from_state, event.to_state) == (State.PROVISIONING, State.TERMINATING)


def test_it_gives_up_when_the_race_leaves_the_row_outside_its_from_states(make_tenant, monkeypatch):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.PROVISIONING, generation=1)
    real_update = QuerySet.update

    def update_after_a_race(self, **kwargs):
        if self.model is Sandbox:
            real_update(Sandbox.objects.filter(pk=sandbox.pk), state=State.READY)
        return real_update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", update_after_a_race)
    moved = lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.PROVISIONING,),
        to_state=State.FAILED,
        reason="provision_error",
    )
    assert moved is False
    assert sandbox.state == State.READY
    assert not SandboxEvent.objects.filter(sandbox=sandbox).exists()


def _row_statements(queries: list[dict[str, str]]) -> list[str]:
    """The statements that touch the sandbox row itself (not its events or usage)."""
    return [
        q["sql"].split(" ", 1)[0]
        for q in queries
        if '"sandboxes_sandbox"' in q["sql"].split(" WHERE ")[0]
    ]


def test_it_leaves_the_instance_equal_to_the_row_without_reading_it_back(make_tenant):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from apps.billing.models import UsageRecord

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0, node="")
    steps: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
        ((State.REQUESTED,), State.PROVISIONING, {"bump_generation": True}),
        ((State.PROVISIONING,), State.READY, {"node": "node-a", "ready_at": timezone.now()}),
        ((State.READY,), State.TERMINATING, {}),
        ((State.TERMINATING,), State.DELETED, {"terminated_at": timezone.now()}),
    ]
    usage: dict[str, list[str]] = {}
    for from_states, to_state, fields in steps:
        with CaptureQueriesContext(connection) as captured:
            assert lifecycle.sandbox_transition(
                sandbox=sandbox, from_states=from_states, to_state=to_state, reason="t", **fields
            )
        # The instance is as the row: the compare-and-set is the UPDATE alone (on the
        # state and generation this instance holds), and the ledger hook (usage
        # metering) uses this instance instead of reading the row again.
        assert _row_statements(captured.captured_queries) == ["UPDATE"], to_state
        usage[to_state] = [
            q["sql"].split(" ", 1)[0]
            for q in captured.captured_queries
            if '"billing_usagerecord"' in q["sql"].split(" WHERE ")[0]
        ]
        row = Sandbox.objects.get(pk=sandbox.pk)
        for name in ("state", "generation", "updated_at", "node", "ready_at", "terminated_at"):
            assert getattr(sandbox, name) == getattr(row, name), (to_state, name)
    assert sandbox.generation == 1
    record = UsageRecord.objects.get(sandbox=sandbox)
    events = {
        e.to_state: e.at for e in SandboxEvent.objects.filter(sandbox=sandbox, event="transition")
    }
    assert record.started_at == events[State.PROVISIONING]
    assert record.ended_at == events[State.DELETED]
    assert (record.node, record.end_state, record.end_reason) == ("node-a", State.DELETED, "t")
    # The record is opened once (a read to find none, an insert); the node and the end
    # are one UPDATE each, without reading the record or the ledger back.
    assert usage == {
        State.PROVISIONING: ["SELECT", "INSERT"],
        State.READY: ["UPDATE"],
        State.TERMINATING: [],
        State.DELETED: ["UPDATE"],
    }


def test_a_stale_instance_reads_the_row_and_moves_from_what_it_holds(make_tenant):
    """The first compare-and-set uses the instance's state and generation; when the row
    has moved on (here: claimed by a provisioner since this instance was loaded) that
    UPDATE changes nothing, and the transition reads the row and moves from there."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    Sandbox.objects.filter(pk=sandbox.pk).update(state=State.PROVISIONING, generation=1)
    with CaptureQueriesContext(connection) as captured:
        moved = lifecycle.sandbox_transition(
            sandbox=sandbox,
            from_states=(State.REQUESTED, State.PROVISIONING),
            to_state=State.TERMINATING,
            reason="deleted",
        )
    assert moved is True
    assert _row_statements(captured.captured_queries) == ["UPDATE", "SELECT", "UPDATE"]
    row = Sandbox.objects.get(pk=sandbox.pk)
    assert (row.state, row.generation) == (State.TERMINATING, 1)
    assert (sandbox.state, sandbox.generation) == (State.TERMINATING, 1)
    event = SandboxEvent.objects.get(sandbox=sandbox, event="transition")
    assert (event.from_state, event.to_state, event.generation) == (
        State.PROVISIONING,
        State.TERMINATING,
        1,
    )


def test_a_stale_instance_outside_the_row_s_state_does_not_move_it(make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.READY, generation=1)
    Sandbox.objects.filter(pk=sandbox.pk).update(state=State.TERMINATING)
    moved = lifecycle.sandbox_transition(
        sandbox=sandbox, from_states=(State.READY,), to_state=State.LOST, reason="gone"
    )
    assert moved is False
    assert sandbox.state == State.TERMINATING
    assert Sandbox.objects.get(pk=sandbox.pk).state == State.TERMINATING
    assert not SandboxEvent.objects.filter(sandbox=sandbox).exists()


def test_it_reads_the_row_when_the_instance_is_stale(make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.READY, generation=1)
    # Re-provisioned behind this instance's back: same state, a newer generation.
    Sandbox.objects.filter(pk=sandbox.pk).update(generation=2)
    assert lifecycle.sandbox_transition(
        sandbox=sandbox, from_states=(State.READY,), to_state=State.TERMINATING, reason="t"
    )
    row = Sandbox.objects.get(pk=sandbox.pk)
    assert (row.state, row.generation) == (State.TERMINATING, 2)
    assert (sandbox.state, sandbox.generation) == (State.TERMINATING, 2)
    event = SandboxEvent.objects.get(sandbox=sandbox, event="transition")
    assert (event.from_state, event.generation) == (State.READY, 2)
    # An instance that is stale and outside the from_states: nothing moves.
    other = make_sandbox(tenant, state=State.READY, generation=1)
    Sandbox.objects.filter(pk=other.pk).update(state=State.DELETED)
    assert not lifecycle.sandbox_transition(
        sandbox=other, from_states=(State.READY,), to_state=State.TERMINATING, reason="t"
    )
    assert other.state == State.DELETED
    assert not SandboxEvent.objects.filter(sandbox=other).exists()
