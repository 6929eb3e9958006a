"""A create's row and its ``created`` ledger row are written by one statement while the
tenant's quota row is held (issue 17: a burst of one tenant's creates is answered one
at a time, so every round trip inside that lock counts), with the same rows as before,
and a clash on the idempotency key or the id still rolls back whole."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_insert

pytestmark = pytest.mark.django_db


def _create(tenant, name, **request):
    return sandbox_create(
        tenant=tenant,
        request=SandboxRequest(
            image="host", cpu_millis=500, memory_mib=256, external_id=name, **request
        ),
        idempotency_key=f"key-{name}",
        actor="key:test",
    )


def test_a_create_writes_its_row_and_created_ledger_row(make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    sandbox, created = _create(tenant, "sb-one")
    assert created and sandbox.state == State.REQUESTED and not sandbox._state.adding
    row = Sandbox.objects.get(external_id="sb-one")
    assert (row.pk, row.tenant_id, row.state, row.idempotency_key) == (
        sandbox.pk,
        tenant.pk,
        State.REQUESTED,
        "key-sb-one",
    )
    assert row.updated_at is not None and row.created_at == sandbox.created_at
    ledger = list(SandboxEvent.objects.filter(sandbox=row).values_list(
        "tenant_id", "event", "from_state", "to_state", "reason", "message", "actor", "generation"
    ))  # fmt: skip
    assert ledger == [(tenant.pk, "created", "", State.REQUESTED, "api", "", "key:test", 0)]
    # the same key again is a replay of the same sandbox, nothing new written
    again, created_again = _create(tenant, "sb-one")
    assert (again.pk, created_again) == (sandbox.pk, False)
    assert SandboxEvent.objects.filter(sandbox=row).count() == 1


def _unsaved(tenant, name):
    now = timezone.now()
    return Sandbox(
        tenant=tenant,
        external_id=name,
        image="host",
        backend="local",
        cpu_millis=500,
        memory_mib=256,
        ttl_seconds=3600,
        expires_at=now + timedelta(hours=1),
        last_heartbeat_at=now,
        created_at=now,
    )


def test_the_insert_is_one_statement(make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    sandbox = _unsaved(tenant, "sb-two")
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        sandbox_insert(sandbox=sandbox, state=State.QUEUED, actor="key:test")
    assert len(queries.captured_queries) == 1
    assert Sandbox.objects.get(pk=sandbox.pk).state == State.QUEUED
    assert SandboxEvent.objects.get(sandbox=sandbox).to_state == State.QUEUED


def test_a_clashing_id_writes_neither_row(make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    _create(tenant, "sb-three")
    twin = _unsaved(tenant, "sb-three")
    with pytest.raises(IntegrityError), transaction.atomic():
        sandbox_insert(sandbox=twin, state=State.REQUESTED, actor="key:test")
    assert not Sandbox.objects.filter(pk=twin.pk).exists()
    assert not SandboxEvent.objects.filter(sandbox_id=twin.pk).exists()
    assert Sandbox.objects.filter(tenant=tenant).count() == 1
