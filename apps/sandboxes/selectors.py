"""Tenant-scoped reads. Another tenant's object is NotFound, never Forbidden."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.db.models import Q, QuerySet

from apps.core.dbrows import instance_from_row, select_list
from apps.core.errors import NotFound, ValidationFailed
from apps.core.keyset import decode_cursor, encode_cursor
from apps.sandboxes.models import Operation, Sandbox, SandboxEvent, Snapshot, SnapshotState
from apps.tenancy.models import Tenant


def sandbox_list(
    *,
    tenant: Tenant,
    state: str | None = None,
    image: str | None = None,
    labels: list[str] | None = None,
) -> QuerySet[Sandbox]:
    """The tenant's sandboxes, newest first (ties broken by id, so pages are stable).
    ``labels``: each ``key=value`` must match, a bare ``key`` must be present."""
    qs = Sandbox.objects.for_tenant(tenant).order_by("-created_at", "-id")
    if state:
        qs = qs.filter(state__in=state.split(","))
    if image:
        qs = qs.filter(image=image)
    for selector in labels or ():
        key, eq, value = selector.partition("=")
        if not key:
            raise ValidationFailed(
                f"label filter {selector!r} is not key=value or key", field="label"
            )
        qs = qs.filter(labels__contains={key: value}) if eq else qs.filter(labels__has_key=key)
    return qs


MAX_PAGE = 1000


def page_limit(raw: str | None, *, default: int, field: str = "limit") -> int:
    """A page size from a query parameter: 1…MAX_PAGE, else a typed 400."""
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise ValidationFailed(f"{field} must be an integer from 1 to {MAX_PAGE}", field=field)
    return int(raw)


def sandbox_keyset_page(
    qs: QuerySet[Sandbox], *, cursor: str | None, limit: int, newest_first: bool = True
) -> tuple[list[Sandbox], str | None]:
    """One keyset page of ``qs`` ordered by (created_at, id), newest or oldest first:
    the sandboxes after ``cursor`` and the cursor of the next page (None on the last).
    Keyset, not offset: a sandbox created or deleted between two pages neither repeats
    nor hides another. A cursor is opaque; a malformed one is a 400 (the API's callers
    must learn their cursor is wrong, unlike the dashboard's, which starts over)."""
    op = "lt" if newest_first else "gt"
    qs = qs.order_by(*(("-created_at", "-id") if newest_first else ("created_at", "id")))
    if cursor:
        after = decode_cursor(cursor)
        if after is None or after[0].tzinfo is None:
            raise ValidationFailed("cursor is not a cursor this server gave", field="cursor")
        created_at, pk = after
        qs = qs.filter(
            Q(**{f"created_at__{op}": created_at}) | Q(created_at=created_at, **{f"id__{op}": pk})
        )
    rows = list(qs[: limit + 1])
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, encode_cursor(rows[-1].created_at, rows[-1].pk)


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


# ---- the dashboard's list: filters, search, keyset pages -----------------------------

SANDBOX_SORTS = {
    # name: (ordering field, descending)
    "newest": ("created_at", True),
    "oldest": ("created_at", False),
    "expiring": ("expires_at", False),
}


@dataclass(frozen=True)
class SandboxPage:
    rows: list[Sandbox]
    next_cursor: str  # "" on the last page


def sandbox_page(
    *,
    tenant: Tenant,
    states: list[str] | None = None,
    image: str | None = None,
    search: str = "",
    labels: dict[str, str] | None = None,
    sort: str = "newest",
    cursor: str = "",
    limit: int = 50,
) -> SandboxPage:
    """One page of the tenant's sandboxes, newest first by default. ``search`` matches
    an id (or its prefix, with or without ``sb-``) or a label value; ``labels`` must all
    match exactly. Keyset pagination on (sort field, id): a page stays correct while
    sandboxes are created or deleted, unlike an offset. A bad cursor starts over."""
    field, descending = SANDBOX_SORTS.get(sort, SANDBOX_SORTS["newest"])
    qs = Sandbox.objects.for_tenant(tenant)
    if states:
        qs = qs.filter(state__in=states)
    if image:
        qs = qs.filter(image=image)
    if field == "expires_at":
        qs = qs.filter(expires_at__isnull=False)
    for key, value in (labels or {}).items():
        qs = qs.filter(labels__contains={key: value})
    term = search.strip()
    if term:
        ident = term if term.startswith("sb-") else f"sb-{term}"
        # a label value: jsonb has no "any value contains", so the text of the
        # object is searched for the quoted value (exact values, no substrings)
        qs = qs.filter(
            Q(external_id__startswith=ident)
            | Q(labels__icontains=f'"{term}"')
            | Q(labels__has_key=term)
        )
    after = decode_cursor(cursor)
    if after is not None:
        last, pk = after
        op = "lt" if descending else "gt"
        qs = qs.filter(Q(**{f"{field}__{op}": last}) | Q(**{field: last, f"id__{op}": pk}))
    order = [f"-{field}", "-id"] if descending else [field, "id"]
    rows = list(qs.order_by(*order)[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = encode_cursor(getattr(rows[-1], field), rows[-1].pk) if more else ""
    return SandboxPage(rows, next_cursor)


def snapshot_list(*, tenant: Tenant | None, sandbox: Sandbox | None = None) -> QuerySet[Snapshot]:
    """The tenant's snapshots that exist or are being captured, newest first."""
    qs = Snapshot.objects.for_tenant(tenant).exclude(state=SnapshotState.DELETED)
    if sandbox is not None:
        qs = qs.filter(sandbox=sandbox)
    return qs.select_related("sandbox", "parent").order_by("-created_at", "-id")


def snapshot_get(*, tenant: Tenant | None, snapshot_id: str) -> Snapshot:
    """The tenant's snapshot (deleted ones too: their record stays); another
    tenant's, or a malformed id, is a 404."""
    try:
        pk = uuid.UUID(snapshot_id)
    except ValueError:
        pk = None
    snapshot = (
        Snapshot.objects.for_tenant(tenant)
        .select_related("sandbox", "parent")
        .filter(pk=pk)
        .first()
        if pk is not None
        else None
    )
    if snapshot is None:
        raise NotFound(f"no snapshot {snapshot_id!r}", code="snapshot_not_found")
    return snapshot
