"""Tenant-scoped reads. Another tenant's object is NotFound, never Forbidden."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.db import connection
from django.db.models import QuerySet
from django.db.models.expressions import Col

from apps.billing.models import Tenant
from apps.sandboxes.models import Operation, Sandbox, SandboxEvent
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


_Converter = Callable[[Any, Any, Any], Any]


@functools.cache
def _sandbox_select() -> tuple[str, list[str], list[tuple[int, Col, list[_Converter]]]]:
    """``SELECT <every column> FROM sandboxes``, the attribute names and each column's
    converters (JSON labels), as the ORM's ModelIterable applies them."""
    meta = Sandbox._meta
    fields = meta.concrete_fields
    cols = ", ".join(f'"{f.column}"' for f in fields)
    converters = []
    for i, f in enumerate(fields):
        col = f.get_col(meta.db_table)
        found = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
        if found:
            converters.append((i, col, found))
    # Identifiers only from the model's own metadata; values are parameters.
    select = f'SELECT {cols} FROM "{meta.db_table}" WHERE '  # noqa: S608
    return select, [f.attname for f in fields], converters


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
    select, names, converters = _sandbox_select()
    with connection.cursor() as cursor:
        cursor.execute(
            f'{select}"{tenant_column}" = %s AND "{column}" = %s LIMIT 1',
            [tenant.pk, value],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    values = list(row)
    for i, col, functions in converters:
        for convert in functions:
            values[i] = convert(values[i], col, connection)
    return Sandbox.from_db(connection.alias, names, values)


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
