"""Compare-and-set transitions under a race: a move that is still valid is retried,
never silently dropped."""

from __future__ import annotations

from typing import Any

import pytest

from apps.billing.models import UsageRecord
from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services import lifecycle
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def test_it_still_deletes_when_provisioning_claims_the_row_mid_transition(make_tenant, monkeypatch):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    real_cas = lifecycle._compare_and_set
    raced = {"done": False}

    def cas_after_a_race(*args: Any, **kwargs: Any) -> Any:
        # Between the delete's read and its compare-and-set, the provisioner claims
        # the row.
        if not raced["done"]:
            raced["done"] = True
            Sandbox.objects.filter(pk=sandbox.pk).update(state=State.PROVISIONING, generation=1)
        return real_cas(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "_compare_and_set", cas_after_a_race)
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
    real_cas = lifecycle._compare_and_set

    def cas_after_a_race(*args: Any, **kwargs: Any) -> Any:
        Sandbox.objects.filter(pk=sandbox.pk).update(state=State.READY)
        return real_cas(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "_compare_and_set", cas_after_a_race)
    moved = lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.PROVISIONING,),
        to_state=State.FAILED,
        reason="provision_error",
    )
    assert moved is False
    assert sandbox.state == State.READY
    assert not SandboxEvent.objects.filter(sandbox=sandbox).exists()
    assert not UsageRecord.objects.filter(sandbox=sandbox).exists()


def _statements(queries: list[dict[str, str]]) -> list[str]:
    """The first word of each statement: WITH is the transition's one statement."""
    return [q["sql"].split(" ", 1)[0] for q in queries]


def test_it_moves_logs_and_meters_in_one_statement_per_transition(make_tenant):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0, node="")
    steps: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
        ((State.REQUESTED,), State.PROVISIONING, {"bump_generation": True}),
        ((State.PROVISIONING,), State.READY, {"node": "node-a", "ready_at": timezone.now()}),
        ((State.READY,), State.TERMINATING, {}),
        ((State.TERMINATING,), State.DELETED, {"terminated_at": timezone.now()}),
    ]
    statements: dict[str, list[str]] = {}
    for from_states, to_state, fields in steps:
        with CaptureQueriesContext(connection) as captured:
            assert lifecycle.sandbox_transition(
                sandbox=sandbox, from_states=from_states, to_state=to_state, reason="t", **fields
            )
        statements[to_state] = _statements(captured.captured_queries)
        # The instance is as the row, without reading the row back.
        row = Sandbox.objects.get(pk=sandbox.pk)
        for name in ("state", "generation", "updated_at", "node", "ready_at", "terminated_at"):
            assert getattr(sandbox, name) == getattr(row, name), (to_state, name)
    # The compare-and-set, the ledger row and the usage write are one statement (no
    # BEGIN/COMMIT, no savepoint, no read of the record or of the price book).
    assert statements == {
        State.PROVISIONING: ["WITH"],
        State.READY: ["WITH"],
        State.TERMINATING: ["WITH"],
        State.DELETED: ["WITH"],
    }
    assert sandbox.generation == 1
    record = UsageRecord.objects.get(sandbox=sandbox)
    events = {
        e.to_state: e for e in SandboxEvent.objects.filter(sandbox=sandbox, event="transition")
    }
    assert [(e.from_state, e.generation) for e in events.values()] == [
        (State.REQUESTED, 1),
        (State.PROVISIONING, 1),
        (State.READY, 1),
        (State.TERMINATING, 1),
    ]
    assert all(e.tenant_id == tenant.pk and e.reason == "t" for e in events.values())
    assert record.started_at == events[State.PROVISIONING].at
    assert record.ended_at == events[State.DELETED].at
    assert (record.node, record.end_state, record.end_reason) == ("node-a", State.DELETED, "t")
    assert (record.tenant_id, record.cpu_millis, record.memory_mib, record.image) == (
        tenant.pk,
        sandbox.cpu_millis,
        sandbox.memory_mib,
        sandbox.image,
    )


@pytest.mark.parametrize(
    ("labels", "spot_row", "expected_rate"),
    [
        # 1 MiB at 0.005/GiB-hour is 0.0000048828125/h: a tie at the 13th place.
        ({}, False, "0.000004882813"),
        ({"capacity": "spot"}, True, "0.000001464844"),  # 0.0015/GiB-hour
        ({"capacity": "spot"}, False, "0.000004882813"),  # no spot row: on demand
    ],
)
def test_it_opens_the_record_at_the_price_the_orm_path_sets(
    make_tenant, labels, spot_row, expected_rate
):
    """The record the transition's statement opens (price looked up and computed in
    SQL) is the one the ORM's path (``usage_record_sync``, which the sweep uses) makes
    from the ledger: same book, same row, same rate rounded the same way."""
    from datetime import UTC, datetime
    from decimal import Decimal

    from apps.billing.models import PriceBook, PriceRate
    from apps.sandboxes.metering.usage import usage_record_sync

    old = PriceBook.objects.create(
        slug="hedgerow", name="t", version=8, effective_from=datetime(2025, 1, 1, tzinfo=UTC)
    )
    book = PriceBook.objects.create(
        slug="hedgerow", name="t", version=9, effective_from=datetime(2026, 1, 1, tzinfo=UTC)
    )
    later = PriceBook.objects.create(
        slug="hedgerow", name="t", version=10, effective_from=datetime(2999, 1, 1, tzinfo=UTC)
    )
    for b, factor in ((old, 7), (book, 1), (later, 3)):
        PriceRate.objects.create(
            price_book=b,
            capacity_type="on_demand",
            vcpu_hour=Decimal("0.04") * factor,
            gib_hour=Decimal("0.005") * factor,
            startup_fee=Decimal("0.0005"),
        )
        if spot_row:
            PriceRate.objects.create(
                price_book=b,
                capacity_type="spot",
                vcpu_hour=Decimal("0.012") * factor,
                gib_hour=Decimal("0.0015") * factor,
                startup_fee=Decimal("0.0005"),
            )
    tenant, _ = make_tenant()
    sandbox = make_sandbox(
        tenant, state=State.REQUESTED, generation=0, cpu_millis=0, memory_mib=1, labels=labels
    )
    assert lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED,),
        to_state=State.PROVISIONING,
        reason="scheduled",
        bump_generation=True,
    )
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert record.price_book_id == book.pk
    assert record.hourly_rate == Decimal(expected_rate)  # Postgres rounds ties up
    UsageRecord.objects.filter(pk=record.pk).delete()
    synced = usage_record_sync(sandbox_id=sandbox.pk)
    assert synced is not None
    synced.refresh_from_db()
    fields: tuple[str, ...] = ("price_book_id", "hourly_rate", "startup_fee", "started_at")
    fields += ("capacity_type", "cpu_millis", "memory_mib", "labels", "node", "ended_at")
    fields += ("tenant_id", "image")
    assert {f: getattr(record, f) for f in fields} == {f: getattr(synced, f) for f in fields}


def test_it_opens_the_record_with_the_default_books_when_there_are_none(make_tenant):
    from apps.billing.models import PriceBook, PriceRate

    PriceRate.objects.all().delete()
    PriceBook.objects.all().delete()
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    assert lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED,),
        to_state=State.PROVISIONING,
        reason="scheduled",
        bump_generation=True,
    )
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert str(record.price_book) == "hedgerow v1"
    started = SandboxEvent.objects.get(sandbox=sandbox, to_state=State.PROVISIONING)
    assert record.started_at == started.at


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
    assert _statements(captured.captured_queries) == ["WITH", "SELECT", "WITH"]
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


def test_it_repairs_a_record_the_end_did_not_find_from_the_ledger(make_tenant):
    """A record missing at the end (its opening write lost) is rebuilt from the ledger
    by the transition itself, as the post_save hook did, not left to the sweep."""
    from django.utils import timezone

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0, node="")
    assert lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED,),
        to_state=State.PROVISIONING,
        reason="scheduled",
        bump_generation=True,
        provisioning_started_at=timezone.now(),
    )
    UsageRecord.objects.filter(sandbox=sandbox).delete()
    assert lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.PROVISIONING,),
        to_state=State.FAILED,
        reason="provision_error",
        message="boom",
    )
    record = UsageRecord.objects.get(sandbox=sandbox)
    ledger = SandboxEvent.objects.filter(sandbox=sandbox, event="transition")
    assert record.started_at == ledger.get(to_state=State.PROVISIONING).at
    assert record.ended_at == ledger.get(to_state=State.FAILED).at
    assert (record.end_state, record.end_reason) == (State.FAILED, "provision_error")
