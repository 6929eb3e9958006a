"""Orchard Env sandboxes and resources on top of Hedgerow's own services.

Nothing here changes state by itself: creates, deletes and heartbeats go through
``apps.sandboxes.services.lifecycle`` (quotas, ledger, idempotency and the state
machine all apply); this module only translates Orchard's request and response shapes.
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.db.models import Count, Sum

from apps.billing.models import TenantQuota
from apps.core.errors import ApiError, ValidationFailed
from apps.sandboxes.models import LIVE_STATES, Sandbox, State
from apps.sandboxes.quantities import QuantityError, parse_cpu_millis, parse_memory_mib
from apps.sandboxes.services.lifecycle import (
    SandboxRequest,
    egress_policy,
    sandbox_create,
    validate_external_id,
)
from apps.tenancy.models import Tenant
from apps.tenancy.principal import Principal

DEFAULT_CPU_MILLIS = 1000
DEFAULT_MEMORY_MIB = 1024

# Orchard's statuses are Kubernetes pod phases; ours are a richer state machine.
_STATUS = {
    State.QUEUED: "pending",
    State.REQUESTED: "pending",
    State.PROVISIONING: "pending",
    State.READY: "ready",
    State.PAUSED: "paused",
    State.FAILED: "failed",
    State.LOST: "failed",
    State.TERMINATING: "terminating",
    State.DELETED: "deleted",
}


def _bool(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValidationFailed(f"{name} must be true or false", field=name)
    return value


def _image(requested: Any) -> str:
    """The image exactly as named: ``host``, an imported image or an OCI reference.
    ``HEDGEROW_ORCHARD_DEFAULT_IMAGE`` applies only when the body names none; an image
    that cannot be had is the create's typed 4xx (``sandbox_create`` resolves it with
    the tenant's credentials), never another image in its place."""
    if requested is None:
        requested = settings.HEDGEROW_ORCHARD_DEFAULT_IMAGE or "host"
    if not isinstance(requested, str) or not requested.strip() or len(requested) > 200:
        raise ValidationFailed("image must be a non-empty string", field="image")
    return requested


def _quantity(data: dict[str, Any], name: str, parser: Any, default: int, limit: int) -> int:
    raw = data.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(parser(raw))
    except QuantityError as exc:
        raise ValidationFailed(str(exc), field=name, code="invalid_quantity") from exc
    if value > limit:
        raise ValidationFailed(f"{name} {raw!r} exceeds the limit", field=name, code="too_large")
    return value


def orchard_create_request(data: dict[str, Any]) -> tuple[SandboxRequest, float | None]:
    """Validates an Orchard create body → (Hedgerow request, readiness timeout)."""
    sandbox_id = data.get("sandbox_id")
    if sandbox_id is not None:
        if not isinstance(sandbox_id, str):
            raise ValidationFailed("sandbox_id must be a string", field="sandbox_id")
        validate_external_id(sandbox_id)
    timeout = data.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise ValidationFailed("timeout must be a positive number of seconds", field="timeout")
    memory = _quantity(
        data, "memory", parse_memory_mib, DEFAULT_MEMORY_MIB, settings.HEDGEROW_MAX_MEMORY_MIB
    )
    if memory < 32:
        raise ValidationFailed("at least 32Mi memory", field="memory", code="too_small")
    block = data.get("block_network")
    policy = egress_policy(
        data.get("egress"), None if block is None else not _bool(data, "block_network", True)
    )
    request = SandboxRequest(
        image=_image(data.get("image")),
        cpu_millis=_quantity(
            data, "cpu", parse_cpu_millis, DEFAULT_CPU_MILLIS, settings.HEDGEROW_MAX_CPU_MILLIS
        ),
        memory_mib=memory,
        network_access=policy.routed,
        egress=policy.to_json(),
        ttl_seconds=settings.HEDGEROW_DEFAULT_TTL_S,
        external_id=sandbox_id,
    )
    return request, float(timeout) if timeout is not None else None


def orchard_sandbox_create(
    *, principal: Principal, data: dict[str, Any]
) -> tuple[Sandbox, float | None]:
    """Creates a sandbox from an Orchard body through ``sandbox_create`` (admission,
    ledger and the enqueue included). A taken ``sandbox_id`` is a 409, never a shared
    sandbox. A full quota becomes 503 + Retry-After: the only status the Orchard SDK
    retries, and the right one for "try again shortly"."""
    request, timeout = orchard_create_request(data)
    try:
        sandbox, _ = sandbox_create(
            tenant=principal.tenant, request=request, idempotency_key=None, actor=principal.actor
        )
    except ApiError as exc:
        if exc.status_code == 429:
            exc.status_code = 503
            exc.headers.setdefault("Retry-After", "5")
        raise
    return sandbox, timeout


def orchard_sandbox_view(sandbox: Sandbox, *, timeout: float | None = None) -> dict[str, Any]:
    status = _STATUS.get(State(sandbox.state), sandbox.state)
    message = sandbox.status_message
    if sandbox.state == State.QUEUED and not message:
        message = "queued: waiting for the team's quota"
    return {
        "sandbox_id": sandbox.external_id,
        "status": status,
        "ready": sandbox.state == State.READY,
        "status_message": message,
        "state": sandbox.state,
        "image": sandbox.image,
        "namespace": sandbox.tenant.slug,
        "block_network": not sandbox.network_access,
        "egress": sandbox.egress,
        "cpu": f"{sandbox.cpu_millis}m",
        "memory": f"{sandbox.memory_mib}Mi",
        "timeout": timeout if timeout is not None else settings.HEDGEROW_READY_TIMEOUT_S,
        "created_at": sandbox.created_at.timestamp(),
        "expires_at": sandbox.expires_at.timestamp(),
    }


def _host_capacity() -> tuple[int, int]:
    """(cpu millis, memory MiB) of this machine: the local backend's whole capacity."""
    cpu = (os.cpu_count() or 1) * 1000
    memory = 0
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) // 1024
                    break
    except OSError:
        pass
    return cpu, memory


def _amounts(cpu: int | None, memory: int | None, sandboxes: int | None) -> dict[str, Any]:
    return {
        "cpu": f"{cpu}m" if cpu is not None else None,
        "cpu_millis": cpu,
        "memory": f"{memory}Mi" if memory is not None else None,
        "memory_mib": memory,
        "sandboxes": sandboxes,
    }


def orchard_resources(*, tenant: Tenant) -> dict[str, Any]:
    """What this team may still start: its quota (or, without one, the machine's size)
    minus what its live sandboxes hold."""
    live = Sandbox.objects.for_tenant(tenant).filter(state__in=LIVE_STATES)
    used = live.aggregate(cpu=Sum("cpu_millis"), memory=Sum("memory_mib"), n=Count("id"))
    used_cpu, used_memory, used_n = used["cpu"] or 0, used["memory"] or 0, used["n"] or 0
    quota = TenantQuota.objects.filter(tenant=tenant).first()
    host_cpu, host_memory = _host_capacity()
    cpu = quota.max_cpu_millis if quota and quota.max_cpu_millis else host_cpu
    memory = quota.max_memory_mib if quota and quota.max_memory_mib else host_memory
    count = quota.max_concurrent_sandboxes if quota else None
    if not count and settings.HEDGEROW_MAX_LIVE_SANDBOXES:
        count = settings.HEDGEROW_MAX_LIVE_SANDBOXES
    capacity = _amounts(cpu, memory, count or None)
    return {
        "namespace": tenant.slug,
        "backend": settings.HEDGEROW_BACKEND,
        "capacity": capacity,
        "allocatable": capacity,
        "requested": _amounts(used_cpu, used_memory, used_n),
        "available": _amounts(
            max(cpu - used_cpu, 0),
            max(memory - used_memory, 0),
            max(count - used_n, 0) if count else None,
        ),
    }
