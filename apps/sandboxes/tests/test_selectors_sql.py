"""``sandbox_get`` and ``sandbox_by_idempotency_key`` read with one hand-written statement
(apps/sandboxes/selectors.py): they must return what the ORM returns — every field,
converted the same way — and never another tenant's sandbox."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.core.errors import NotFound
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.selectors import sandbox_by_idempotency_key, sandbox_get, sandbox_refresh
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def _fields(sandbox: Sandbox) -> dict[str, object]:
    return {f.attname: getattr(sandbox, f.attname) for f in Sandbox._meta.concrete_fields}


def test_it_returns_what_the_orm_returns(make_tenant):
    tenant, _ = make_tenant()
    now = timezone.now()
    full = make_sandbox(
        tenant,
        external_id="sb-full",
        labels={"capacity": "spot", "run": "42"},
        idempotency_key="key-1",
        heartbeat_timeout_s=30,
        last_heartbeat_at=now,
        ready_at=now + timedelta(seconds=1),
        node="node-a",
        status_message="ok",
    )
    bare = make_sandbox(tenant, external_id="sb-bare", state=State.REQUESTED, endpoint_port=None)
    for sandbox in (full, bare):
        orm = Sandbox.objects.for_tenant(tenant).filter(external_id=sandbox.external_id).first()
        assert orm is not None
        got = sandbox_get(tenant=tenant, sandbox_id=sandbox.external_id)
        assert type(got) is Sandbox and not got._state.adding and got._state.db == "default"
        assert _fields(got) == _fields(orm)
    assert sandbox_get(tenant=tenant, sandbox_id="sb-full").labels == {
        "capacity": "spot",
        "run": "42",
    }
    replay = sandbox_by_idempotency_key(tenant=tenant, idempotency_key="key-1")
    assert replay is not None and _fields(replay) == _fields(full)
    assert sandbox_by_idempotency_key(tenant=tenant, idempotency_key="key-2") is None


def test_it_never_returns_another_tenants_sandbox(make_tenant):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    make_sandbox(other, external_id="sb-theirs", idempotency_key="shared")
    with pytest.raises(NotFound) as caught:
        sandbox_get(tenant=tenant, sandbox_id="sb-theirs")
    assert caught.value.code == "sandbox_not_found"
    assert sandbox_by_idempotency_key(tenant=tenant, idempotency_key="shared") is None
    mine = make_sandbox(tenant, external_id="sb-theirs", idempotency_key="shared")
    assert sandbox_get(tenant=tenant, sandbox_id="sb-theirs").pk == mine.pk
    found = sandbox_by_idempotency_key(tenant=tenant, idempotency_key="shared")
    assert found is not None and found.pk == mine.pk
    assert sandbox_get(tenant=other, sandbox_id="sb-theirs").pk != mine.pk


def test_it_refreshes_an_instance_as_refresh_from_db_does(make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, external_id="sb-r", state=State.REQUESTED, labels={"a": "1"})
    stale = sandbox_get(tenant=tenant, sandbox_id="sb-r")
    Sandbox.objects.filter(pk=sandbox.pk).update(
        state=State.READY, generation=5, node="n1", labels={"b": "2"}, ready_at=timezone.now()
    )
    sandbox_refresh(sandbox=stale)
    orm = Sandbox.objects.get(pk=sandbox.pk)
    assert _fields(stale) == _fields(orm)
    assert stale.state == State.READY and stale.labels == {"b": "2"}
    Sandbox.objects.filter(pk=sandbox.pk).delete()
    with pytest.raises(Sandbox.DoesNotExist):
        sandbox_refresh(sandbox=stale)
