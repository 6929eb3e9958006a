"""Tenant-scoped reads. Another tenant's object is NotFound, never Forbidden."""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.db.models import QuerySet

from apps.billing.models import Tenant
from apps.sandboxes.models import Operation, Sandbox, SandboxEvent
from controlplane.dbrows import instance_from_row, select_list
from controlplane.errors import NotFound


def sandbox_list(
    *, tenant: Tenant, state: str | None = None, image: str | None = None
) -> QuerySet[Sandbox]:
    qs = Sandbox.objects.for_tenant(tenant).order_by("-created_at")
    if state:
        qs = qs.filter(state__in=state.split(","))
    if image:
        qs = qs.filter(image=image)
    return qs


def sandbox_get(*, tenant: Tenant | None, sandbox_id: str) -> Sandbox:
    sandbox = None
    if tenant is not None:  # as ``for_tenant``: no tenant sees nothing
        sandbox = _sandbox_where("tenant_id", tenant.pk, "external_id", sandbox_id)
    if sandbox is None:
        raise NotFound(f"no sandbox {sandbox_id!r}", code="sandbox_not_found")
    return sandbox


def sandbox_by_idempotency_key(*, tenant: Tenant, idempotency_key: str) -> Sandbox | None:
    """The tenant's sandbox created with this key, or None."""
    return _sandbox_where("tenant_id", tenant.pk, "idempotency_key", idempotency_key)


def sandbox_refresh(*, sandbox: Sandbox) -> None:
    """``sandbox.refresh_from_db()`` through the same one-statement read (a wait re-reads
    its sandbox once or twice). Raises ``Sandbox.DoesNotExist`` if the row is gone."""
    fresh = _sandbox_where("id", sandbox.pk, "tenant_id", sandbox.tenant_id)
    if fresh is None:
        raise Sandbox.DoesNotExist(f"sandbox {sandbox.pk} no longer exists")
    # Read by its tenant too, so the one relation (tenant) is unchanged and its cached
    # object, if any, stays valid.
    for f in Sandbox._meta.concrete_fields:
        setattr(sandbox, f.attname, getattr(fresh, f.attname))
    sandbox._state.db = fresh._state.db


def _sandbox_where(first: str, first_value: Any, second: str, second_value: Any) -> Sandbox | None:
    """The sandbox where both columns have these values, as ``Sandbox.objects.filter(
    first=…, second=…).first()`` returns it, without the ORM building and compiling that
    query on every call: ~0.5 ms of a one-row API read's ~3 ms of CPU (py-spy,
    docs/benchmarks.md). Callers pass unique pairs, one of them always the tenant, so
    no ORDER BY is needed. A test holds it to the ORM's answer."""
    table = Sandbox._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            # Identifiers only from the model's metadata and the callers' constants.
            f'SELECT {select_list(Sandbox)} FROM "{table}" '  # noqa: S608
            f'WHERE "{first}" = %s AND "{second}" = %s LIMIT 1',
            [first_value, second_value],
        )
        row = cursor.fetchone()
    return None if row is None else instance_from_row(Sandbox, row)


def sandbox_events(*, sandbox: Sandbox) -> QuerySet[SandboxEvent]:
    return SandboxEvent.objects.filter(sandbox=sandbox).order_by("at", "id")


def operation_list(*, tenant: Tenant, sandbox: Sandbox) -> QuerySet[Operation]:
    return Operation.objects.for_tenant(tenant).filter(sandbox=sandbox).order_by("-created_at")


def operation_get(*, tenant: Tenant, sandbox: Sandbox, operation_id: str) -> Operation:
    operation = (
        Operation.objects.for_tenant(tenant)
        .filter(sandbox=sandbox, operation_id=operation_id)
        .first()
    )
    if operation is None:
        raise NotFound(f"no operation {operation_id!r}", code="operation_not_found")
    return operation
