"""Hot-path limits in Redis: concurrent execs (tenant and key), the exec token bucket and
upload bytes per day. One round trip per check (Lua). Concurrent PTY sessions are
counted by the terminal consumer's own slots; its per-tenant bound comes from here
(``hot_limits().max_pty``).

Concurrency is a sorted set of leases scored by their deadline, not a counter: a web
process that dies mid-exec cannot leak a slot for longer than the lease, so the
counts are self-reconciling across restarts. Limits come from the tenant's quota row,
cached in-process for a few seconds so the hot path does not query Postgres.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.conf import settings

from apps.billing.errors import QuotaExceeded, limit_error
from apps.billing.models import ApiKeyLimits, TenantQuota
from apps.core.errors import ApiError
from apps.core.redis_sync import redis_client

CACHE_S = 5.0

# KEYS: tenant leases, key leases ('' = none), bucket. ARGV: now_ms, lease id,
# deadline_ms, tenant max, key max, rate/s, burst (0 = no limit).
# Returns {0, n} admitted, {1, n} tenant full, {2, n} key full, {3, wait_ms} no token.
_ACQUIRE = """
local now = tonumber(ARGV[1])
local tmax, kmax = tonumber(ARGV[4]), tonumber(ARGV[5])
local rate, burst = tonumber(ARGV[6]), tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if tmax > 0 and n >= tmax then return {1, n} end
if KEYS[2] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local k = redis.call('ZCARD', KEYS[2])
  if kmax > 0 and k >= kmax then return {2, k} end
end
if rate > 0 then
  local b = redis.call('HMGET', KEYS[3], 'tokens', 'ts')
  local tokens = tonumber(b[1]) or burst
  local ts = tonumber(b[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate / 1000)
  if tokens < 1 then return {3, math.ceil((1 - tokens) * 1000 / rate)} end
  redis.call('HSET', KEYS[3], 'tokens', tostring(tokens - 1), 'ts', now)
  redis.call('PEXPIRE', KEYS[3], math.ceil(burst * 1000 / rate) + 60000)
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
if KEYS[2] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
  redis.call('PEXPIREAT', KEYS[2], ARGV[3])
end
return {0, n + 1}
"""
# KEYS: day counter. ARGV: bytes, limit, ttl_s. {0, used} or {1, used}.
_RESERVE_BYTES = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local add, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
if limit > 0 and used + add > limit then return {1, used} end
used = redis.call('INCRBY', KEYS[1], add)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {0, used}
"""


@dataclass(frozen=True)
class HotLimits:
    max_execs: int
    exec_rate: float
    exec_burst: int
    max_upload_bytes: int | None
    upload_bytes_per_day: int
    max_pty: int
    key_max_execs: dict[str, int]


_cache: dict[str, tuple[float, HotLimits]] = {}


def hot_limits(tenant_id: str) -> HotLimits:
    """The tenant's hot-path limits (0 = unlimited), cached for CACHE_S seconds."""
    hit = _cache.get(tenant_id)
    if hit is not None and hit[0] > time.monotonic():
        return hit[1]
    quota = TenantQuota.objects.filter(tenant_id=tenant_id).first()
    keys = ApiKeyLimits.objects.filter(
        api_key__tenant_id=tenant_id, max_concurrent_execs__isnull=False
    ).values_list("api_key_id", "max_concurrent_execs")
    rate = (quota.exec_rate_per_s or 0.0) if quota else 0.0
    limits = HotLimits(
        max_execs=(quota.max_concurrent_execs or 0) if quota else 0,
        exec_rate=rate,
        exec_burst=(quota.exec_burst or max(1, math.ceil(rate))) if quota else 0,
        max_upload_bytes=quota.max_upload_bytes if quota else None,
        upload_bytes_per_day=(quota.upload_bytes_per_day or 0) if quota else 0,
        max_pty=(quota.max_pty_sessions or 0) if quota else 0,
        key_max_execs={str(k): int(v or 0) for k, v in keys},
    )
    _cache[tenant_id] = (time.monotonic() + CACHE_S, limits)
    return limits


def hot_limits_cached(tenant_id: str) -> HotLimits | None:
    """The cached limits without touching the database, or None when not cached (the
    async exec fast path then takes the regular path, which refreshes the cache)."""
    hit = _cache.get(tenant_id)
    if hit is not None and hit[0] > time.monotonic():
        return hit[1]
    return None


def limits_cache_clear() -> None:
    _cache.clear()


@functools.cache
def _script(source: str) -> Any:
    """EVALSHA with a fallback to EVAL on a script-cache miss: one round trip."""
    return redis_client().register_script(source)


def _key(*parts: str) -> str:
    return settings.REDIS_KEY_PREFIX + "quota:" + ":".join(parts)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _acquire(
    *,
    kind: str,
    tenant_id: str,
    key_id: str | None,
    lease: str,
    hold_s: float,
    tmax: int,
    kmax: int,
    rate: float,
    burst: int,
    limit_name: str,
) -> None:
    now = _now_ms()
    keys = [
        _key(kind, tenant_id),
        _key(kind, tenant_id, "key", key_id) if key_id and kmax else "",
        _key("bucket", kind, tenant_id),
    ]
    try:
        code, current = _script(_ACQUIRE)(
            keys=keys, args=[now, lease, now + int(hold_s * 1000), tmax, kmax, rate, burst]
        )
    except redis.RedisError:
        return  # fail open: a Redis hiccup must not take exec down; Postgres limits hold
    if code == 0:
        return
    if code == 1:
        raise limit_error(
            QuotaExceeded,
            limit=limit_name,
            value=tmax,
            current=int(current),
            message=f"this team has its maximum of {tmax} concurrent {kind} sessions running",
            retry=1,
        )
    if code == 2:
        raise limit_error(
            QuotaExceeded,
            limit=f"key_{limit_name}",
            value=kmax,
            current=int(current),
            message=f"this API key has its maximum of {kmax} concurrent {kind} sessions running",
            retry=1,
        )
    raise limit_error(
        QuotaExceeded,
        limit="exec_rate_per_s",
        value=rate,
        current=None,
        message=f"exec rate over this team's {rate:g}/s (burst {burst})",
        retry=max(1, math.ceil(int(current) / 1000)),
    )


def _release(kind: str, tenant_id: str, key_id: str | None, lease: str) -> None:
    try:
        pipe = redis_client().pipeline(transaction=False)
        pipe.zrem(_key(kind, tenant_id), lease)
        if key_id:
            pipe.zrem(_key(kind, tenant_id, "key", key_id), lease)
        pipe.execute()
    except redis.RedisError:
        pass  # the lease expires at its deadline


def exec_admit(*, tenant_id: str, api_key_id: str | None, timeout_s: float) -> str:
    """Takes an exec slot and a rate token or raises 429 naming the limit. Returns the
    lease id for ``exec_release``. The lease outlives the command's own timeout."""
    limits = hot_limits(tenant_id)
    kmax = limits.key_max_execs.get(api_key_id or "", 0)
    lease = uuid.uuid4().hex
    _acquire(
        kind="exec",
        tenant_id=tenant_id,
        key_id=api_key_id,
        lease=lease,
        hold_s=timeout_s + 60,
        tmax=limits.max_execs,
        kmax=kmax,
        rate=limits.exec_rate,
        burst=limits.exec_burst,
        limit_name="max_concurrent_execs",
    )
    return lease


@dataclass(frozen=True)
class ExecAdmitPlan:
    """One exec admission as the raw script call, for a caller with its own (async)
    Redis client: ``script`` with ``keys``/``args``; 0 as the first reply admits;
    ``release_keys`` are the sorted sets to ZREM ``lease`` from afterwards."""

    script: str
    keys: list[str]
    args: list[Any]
    lease: str
    release_keys: list[str]


def exec_admit_plan(
    *, limits: HotLimits, tenant_id: str, api_key_id: str | None, timeout_s: float
) -> ExecAdmitPlan:
    """The same admission as ``exec_admit`` (same keys, lease and limits), unexecuted."""
    kmax = limits.key_max_execs.get(api_key_id or "", 0)
    lease = uuid.uuid4().hex
    now = _now_ms()
    keys = [
        _key("exec", tenant_id),
        _key("exec", tenant_id, "key", api_key_id) if api_key_id and kmax else "",
        _key("bucket", "exec", tenant_id),
    ]
    deadline = now + int((timeout_s + 60) * 1000)
    args: list[Any] = [now, lease, deadline, limits.max_execs, kmax, limits.exec_rate]
    args.append(limits.exec_burst)
    release = [_key("exec", tenant_id)]
    if api_key_id:
        release.append(_key("exec", tenant_id, "key", api_key_id))
    return ExecAdmitPlan(_ACQUIRE, keys, args, lease, release)


def exec_release(*, tenant_id: str, api_key_id: str | None, lease: str) -> None:
    _release("exec", tenant_id, api_key_id, lease)


@dataclass(frozen=True)
class ExecLease:
    tenant_id: str
    api_key_id: str | None
    lease: str

    def release(self) -> None:
        exec_release(tenant_id=self.tenant_id, api_key_id=self.api_key_id, lease=self.lease)


def exec_admit_operation(
    *, principal: Any, operation: Any, is_new: bool, timeout_s: float
) -> ExecLease:
    """The exec hot path's one call: takes a slot and a rate token for ``operation`` or
    raises 429. A refused new operation is removed, so nothing ran and nothing is left
    (a retry with the same operation id starts clean). Call ``.release()`` when done."""
    tenant_id = str(operation.tenant_id)
    key_id = str(principal.api_key.pk) if getattr(principal, "api_key", None) else None
    try:
        lease = exec_admit(tenant_id=tenant_id, api_key_id=key_id, timeout_s=timeout_s)
    except QuotaExceeded:
        if is_new:
            type(operation).objects.filter(pk=operation.pk).delete()
        raise
    return ExecLease(tenant_id=tenant_id, api_key_id=key_id, lease=lease)


@contextmanager
def exec_slot(*, principal: Any, sandbox: Any, timeout_s: float) -> Iterator[None]:
    """``with exec_slot(...)`` around one exec: admit (429s), run, always release."""
    tenant_id = str(sandbox.tenant_id)
    key_id = str(principal.api_key.pk) if getattr(principal, "api_key", None) else None
    lease = exec_admit(tenant_id=tenant_id, api_key_id=key_id, timeout_s=timeout_s)
    try:
        yield
    finally:
        exec_release(tenant_id=tenant_id, api_key_id=key_id, lease=lease)


def _day_key(tenant_id: str) -> tuple[str, int]:
    now = datetime.now(UTC)
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return _key("upload", tenant_id, now.strftime("%Y%m%d")), int((tomorrow - now).total_seconds())


def upload_admit(*, tenant_id: str, size: int | None, max_bytes: int) -> int:
    """Checks one upload against the team's size and daily limits and reserves its
    bytes. Returns the effective per-upload maximum for the agent to enforce."""
    limits = hot_limits(tenant_id)
    if limits.max_upload_bytes is not None:
        max_bytes = min(max_bytes, limits.max_upload_bytes)
    if size is not None and size > max_bytes:
        raise ApiError(
            f"upload of {size} bytes exceeds the limit of {max_bytes}",
            code="too_large",
            status_code=413,
            extra={"limit": "max_upload_bytes", "value": max_bytes, "current": size},
        )
    upload_record(tenant_id=tenant_id, nbytes=size or 0, enforce=True)
    return max_bytes


def upload_record(*, tenant_id: str, nbytes: int, enforce: bool = False) -> None:
    """Adds bytes to today's total (an unknown-length upload is counted after it ends)."""
    limits = hot_limits(tenant_id)
    if not limits.upload_bytes_per_day or (nbytes <= 0 and not enforce):
        return
    key, ttl = _day_key(tenant_id)
    limit = limits.upload_bytes_per_day if enforce else 0
    try:
        code, used = _script(_RESERVE_BYTES)(keys=[key], args=[nbytes, limit, ttl + 3600])
    except redis.RedisError:
        return
    if code == 1:
        raise limit_error(
            QuotaExceeded,
            limit="upload_bytes_per_day",
            value=limits.upload_bytes_per_day,
            current=int(used),
            retry=ttl,
            message=f"{nbytes} more bytes would exceed this team's daily upload limit of "
            f"{limits.upload_bytes_per_day} ({used} used today)",
        )


def limits_current(*, tenant_id: str) -> dict[str, int]:
    """In-flight execs, open PTYs and today's upload bytes (for the quota API)."""
    now = _now_ms()
    try:
        client = redis_client()
        pipe = client.pipeline(transaction=False)
        pipe.zcount(_key("exec", tenant_id), now, "+inf")
        # PTY slots are kept by the terminal consumer (apps/sandboxes/services/pty.py).
        pipe.zcount(f"{settings.REDIS_KEY_PREFIX}pty:tenant:{tenant_id}", time.time(), "+inf")
        pipe.get(_day_key(tenant_id)[0])
        execs, ptys, uploaded = pipe.execute()
    except redis.RedisError:
        return {"execs": 0, "pty_sessions": 0, "upload_bytes_today": 0}
    return {
        "execs": int(execs),
        "pty_sessions": int(ptys),
        "upload_bytes_today": int(uploaded or 0),
    }
