"""Tenant-scoped reads. Another tenant's object is NotFound, never Forbidden."""

from __future__ import annotations

from django.db.models import QuerySet

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
    sandbox = Sandbox.objects.for_tenant(tenant).filter(external_id=sandbox_id).first()
    if sandbox is None:
        raise NotFound(f"no sandbox {sandbox_id!r}", code="sandbox_not_found")
    return sandbox


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
