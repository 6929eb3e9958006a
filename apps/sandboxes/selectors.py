"""Tenant-scoped reads. Another tenant's object is NotFound, never Forbidden."""

from __future__ import annotations

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


def sandbox_get(*, tenant: Tenant, sandbox_id: str) -> Sandbox:
    sandbox = _sandbox_where("tenant_id", tenant, "external_id", sandbox_id)
    if sandbox is None:
        raise NotFound(f"no sandbox {sandbox_id!r}", code="sandbox_not_found")
    return sandbox


def sandbox_by_idempotency_key(*, tenant: Tenant, idempotency_key: str) -> Sandbox | None:
    """The tenant's sandbox created with this key, or None."""
    return _sandbox_where("tenant_id", tenant, "idempotency_key", idempotency_key)


def _sandbox_where(
    tenant_column: str, tenant: Tenant | None, column: str, value: str
) -> Sandbox | None:
    """One sandbox of ``tenant`` by a unique column, as ``Sandbox.objects.for_tenant(
    tenant).filter(column=value).first()`` returns it, without the ORM building and
    compiling that query on every call: ~0.5 ms of a one-row API read's ~3 ms of CPU
    (py-spy, docs/benchmarks.md). Both columns callers pass are unique per tenant, so
    no ORDER BY is needed. A test holds it to the ORM's answer."""
    if tenant is None:
        return None
    table = Sandbox._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            # Identifiers only from the model's metadata and the callers' constants.
            f'SELECT {select_list(Sandbox)} FROM "{table}" '  # noqa: S608
            f'WHERE "{tenant_column}" = %s AND "{column}" = %s LIMIT 1',
            [tenant.pk, value],
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
