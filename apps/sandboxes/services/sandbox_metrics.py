"""A live sandbox's resource counters now (memory, CPU time, pids, disk), read from the
backend's cgroups: one sample per call, nothing stored. The sandbox page keeps the
samples it polled (docs/frontend.md "Metrics")."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from apps.core.errors import Conflict
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import MetricsUnavailable, SandboxMetrics
from apps.sandboxes.models import Sandbox, State


def sandbox_metrics(*, sandbox: Sandbox) -> dict[str, Any]:
    """The sample as JSON: ts, memory_bytes, cpu_usage_ns, pids, disk_bytes, cpu_source,
    with the sandbox's limits beside them. 409 ``sandbox_not_ready`` unless ready; 409
    ``metrics_unavailable`` where the backend has no counters (kubernetes) or the
    sandbox's cgroups are gone."""
    if sandbox.state != State.READY:
        raise Conflict(
            f"a {sandbox.state} sandbox has no metrics",
            code="sandbox_not_ready",
            extra={"state": sandbox.state},
        )
    reader = getattr(get_backend(), "metrics", None)
    try:
        if reader is None:
            raise MetricsUnavailable("this backend does not read sandbox metrics")
        sample: SandboxMetrics = reader(sandbox.id.hex)
    except MetricsUnavailable as exc:
        raise Conflict(
            str(exc), code="metrics_unavailable", extra={"backend": sandbox.backend}
        ) from exc
    body = asdict(sample)
    body.update(
        sandbox=sandbox.external_id,
        memory_limit_bytes=sandbox.memory_mib << 20,
        cpu_millis=sandbox.cpu_millis,
    )
    return body
