"""A live sandbox's resource counters (memory, CPU time, pids, disk), read from the
backend's cgroups, and a bounded history of them on the server.

Every read (``GET /api/v1/sandboxes/<id>/metrics``: the sandbox page polls it) also
appends the sample to a Redis list per sandbox, newest first, at most one sample per
``HEDGEROW_METRICS_HISTORY_MIN_GAP_S`` (several open pages do not fill it faster),
capped at ``HEDGEROW_METRICS_HISTORY_SAMPLES`` and expiring
``HEDGEROW_METRICS_HISTORY_TTL_S`` after the last sample; ``sandbox_destroy`` drops it.
``?since=<unix ts>`` returns the kept samples after ``since`` with the new one, so a
reopened page draws the last minutes (docs/frontend.md "Metrics"). The history is a
convenience: Redis trouble loses history, never the reading."""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import asdict
from typing import Any, cast

import redis
from django.conf import settings

from apps.core.errors import Conflict, ValidationFailed
from apps.core.redis_sync import redis_client
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import MetricsUnavailable, SandboxMetrics
from apps.sandboxes.models import Sandbox, State

log = logging.getLogger(__name__)

# What a kept sample holds (the limits are the sandbox's, the same for every sample).
HISTORY_FIELDS = ("ts", "memory_bytes", "cpu_usage_ns", "pids", "disk_bytes")


def sandbox_metrics(*, sandbox: Sandbox, since: str | None = None) -> dict[str, Any]:
    """The sample as JSON: ts, memory_bytes, cpu_usage_ns, pids, disk_bytes, cpu_source,
    with the sandbox's limits beside them; with ``since`` (unix seconds) also
    ``history``: the kept samples after it, oldest first, this one last. 409
    ``sandbox_not_ready`` unless ready; 409 ``metrics_unavailable`` where the backend has
    no counters (kubernetes) or the sandbox's cgroups are gone; a bad ``since`` is a 400
    naming it."""
    after = _since(since)
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
    kept = {name: body[name] for name in HISTORY_FIELDS}
    history = _record_and_read(sandbox.id, kept, after)
    body.update(
        sandbox=sandbox.external_id,
        memory_limit_bytes=sandbox.memory_mib << 20,
        cpu_millis=sandbox.cpu_millis,
    )
    if after is not None:
        body["history"] = history
    return body


def _since(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValidationFailed("since must be a unix time in seconds", field="since")
    return value


def _key(sandbox_pk: uuid.UUID) -> str:
    return f"{settings.REDIS_KEY_PREFIX}metrics:{sandbox_pk.hex}"


def _record_and_read(
    sandbox_pk: uuid.UUID, sample: dict[str, Any], after: float | None
) -> list[dict[str, Any]]:
    """Appends ``sample`` unless the newest kept one is less than the minimum gap old;
    returns the kept samples after ``after`` (oldest first; [] when not asked)."""
    key = _key(sandbox_pk)
    client = redis_client()
    try:
        newest = cast("bytes | None", client.lindex(key, 0))
        gap = settings.HEDGEROW_METRICS_HISTORY_MIN_GAP_S
        if newest is None or sample["ts"] - json.loads(newest)["ts"] >= gap:
            pipe = client.pipeline(transaction=True)
            pipe.lpush(key, json.dumps(sample))
            pipe.ltrim(key, 0, settings.HEDGEROW_METRICS_HISTORY_SAMPLES - 1)
            pipe.expire(key, int(settings.HEDGEROW_METRICS_HISTORY_TTL_S))
            pipe.execute()
        if after is None:
            return []
        rows = [json.loads(raw) for raw in cast("list[bytes]", client.lrange(key, 0, -1))]
    except redis.RedisError as exc:
        log.warning("metrics history of %s unavailable: %s", sandbox_pk, exc)
        return [sample] if after is not None else []
    kept = sorted((r for r in rows if r["ts"] > after), key=lambda r: r["ts"])
    if not kept or kept[-1]["ts"] != sample["ts"]:
        kept.append(sample)  # within the gap: the reading is still the newest point
    return kept


def metrics_history_drop(*, sandbox_pk: uuid.UUID) -> None:
    """Forgets a sandbox's kept samples (its resources are gone)."""
    try:
        redis_client().delete(_key(sandbox_pk))
    except redis.RedisError as exc:  # the TTL ends it anyway
        log.warning("metrics history of %s not dropped: %s", sandbox_pk, exc)
