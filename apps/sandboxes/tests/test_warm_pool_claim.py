"""What a warm pool claim writes: the same sandbox row, ledger and usage record as the
ORM's way (a create, two ledger rows and the usage hook), in one statement."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.billing.models import UsageRecord
from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services import warm_pool
from apps.tenancy.models import Tenant

pytestmark = pytest.mark.django_db


def _claimed(node: str) -> warm_pool.Claimed:
    return warm_pool.Claimed(
        member_id=uuid.uuid4(),
        generation=1,
        endpoint_host="10.1.2.3",
        endpoint_port=8000,
        isolation="netns+bwrap",
        node=node,
        warm_at=timezone.now() - timedelta(seconds=30),
    )


def _unsaved(tenant: Tenant, claimed: warm_pool.Claimed, external_id: str, **extra: Any) -> Sandbox:
    """The row as ``sandbox_create`` builds it for a claim."""
    now = timezone.now()
    return Sandbox(
        **claimed.sandbox_fields(now),
        state=State.READY,
        admitted_at=now,
        tenant=tenant,
        external_id=external_id,
        image="host",
        cpu_millis=250,
        memory_mib=128,
        network_access=False,
        labels=extra.pop("labels", {"team": "rl"}),
        ttl_seconds=600,
        expires_at=now + timedelta(seconds=600),
        last_heartbeat_at=now,
        request_hash="h",
        backend="local",
        created_by="key:test",
        created_at=now,
        **extra,
    )


def _orm_claim(sandbox: Sandbox, claimed: warm_pool.Claimed, actor: str) -> None:
    """What a claim wrote before it was one statement (the reference)."""
    sandbox.save(force_insert=True)
    common = {"sandbox": sandbox, "tenant_id": sandbox.tenant_id, "actor": actor}
    SandboxEvent.objects.create(
        **common,
        event="created",
        to_state=State.REQUESTED,
        reason="api",
        generation=sandbox.generation,
    )
    assert claimed.warm_at is not None
    SandboxEvent.objects.create(
        **common,
        event="transition",
        from_state=State.REQUESTED,
        to_state=State.READY,
        reason=warm_pool.CLAIM_REASON,
        message=f"claimed a warm pool member (warm since {claimed.warm_at.isoformat()})",
        generation=sandbox.generation,
    )


_EVENT_FIELDS = ("event", "from_state", "to_state", "reason", "message", "actor", "generation")


def _ledger(sandbox: Sandbox) -> list[tuple[Any, ...]]:
    return [
        (e.tenant_id, *(getattr(e, f) for f in _EVENT_FIELDS))
        for e in SandboxEvent.objects.filter(sandbox=sandbox).order_by("at", "id")
    ]


def _record(sandbox: Sandbox) -> dict[str, Any]:
    record = UsageRecord.objects.get(sandbox=sandbox)
    started = SandboxEvent.objects.get(sandbox=sandbox, reason=warm_pool.CLAIM_REASON).at
    assert record.started_at == started  # metering starts at the claim
    fields = model_to_dict(record)
    for name in ("id", "sandbox", "started_at"):
        fields.pop(name)
    return fields


@pytest.mark.parametrize("labels", [{"team": "rl"}, {"capacity": "spot"}])
def test_it_writes_a_claim_as_the_orm_path_does_in_one_statement(make_tenant, labels):
    tenant, _ = make_tenant()
    claimed, reference = _claimed("node-a"), _claimed("node-a")
    ours = _unsaved(tenant, claimed, "sb-claim", labels=dict(labels))
    with CaptureQueriesContext(connection) as captured:
        warm_pool.warm_pool_record_claim(sandbox=ours, claimed=claimed, actor="key:test")
    assert [q["sql"].split(" ", 1)[0] for q in captured.captured_queries] == ["WITH"]
    orm = _unsaved(tenant, reference, "sb-orm", labels=dict(labels))
    _orm_claim(orm, reference, "key:test")

    assert _ledger(ours)[0] == _ledger(orm)[0]
    # The transition's message names the member's warm_at: the same text for the same.
    assert _ledger(ours)[1][:5] == _ledger(orm)[1][:5]
    assert _ledger(ours)[1][6:] == _ledger(orm)[1][6:]
    assert _ledger(ours)[1][5] == (
        f"claimed a warm pool member (warm since {claimed.warm_at.isoformat()})"  # type: ignore[union-attr]
    )
    assert [e[1] for e in _ledger(ours)] == ["created", "transition"]
    assert _record(ours) == _record(orm)
    row, orm_row = Sandbox.objects.get(pk=ours.pk), Sandbox.objects.get(pk=orm.pk)
    skip = {"id", "external_id", "endpoint_port", "created_at", "updated_at"}
    for name in {f.attname for f in Sandbox._meta.concrete_fields} - skip:
        if name in {"provisioning_started_at", "ready_at", "admitted_at", "expires_at"}:
            continue  # set from each create's own clock
        if name == "last_heartbeat_at":
            continue
        assert getattr(row, name) == getattr(orm_row, name), name
    assert (row.state, row.generation, row.node) == (State.READY, 1, "node-a")
    assert ours._state.adding is False  # saved: a later save() updates, never inserts


def test_it_opens_the_record_the_orm_way_without_a_price_book(make_tenant):
    from apps.billing.models import PriceBook

    tenant, _ = make_tenant()
    PriceBook.objects.all().delete()
    claimed = _claimed("node-b")
    sandbox = _unsaved(tenant, claimed, "sb-nobook")
    warm_pool.warm_pool_record_claim(sandbox=sandbox, claimed=claimed, actor="key:test")
    # The statement inserts no record without a book; the repair recreates the books.
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert record.node == "node-b" and record.ended_at is None
    assert record.started_at == SandboxEvent.objects.get(sandbox=sandbox, event="transition").at
