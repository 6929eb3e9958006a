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

# KEYS: tenant leases ('' = none), key leases ('' = none), bucket, then any number of
# per-kind scope sets (sandbox, tenant, installation). ARGV: now_ms, lease id,
# deadline_ms, tenant max, key max, rate/s, burst (0 = no limit), then per scope set
# its max count and max weight (0 = no limit). A lease id ends in ":<weight>" (seconds
# of execution time or bytes; 0 when it weighs nothing), summed against a max weight.
# Returns {0, n} admitted, {1, n} tenant full, {2, n} key full, {3, wait_ms} no
# token, {i, n} scope set KEYS[i] full by count, {100 + i, w} full by weight.
# A set's expiry only ever moves later: a short lease added after a long one must not
# make the long one vanish with the set.
_ACQUIRE = """
local now = tonumber(ARGV[1])
local tmax, kmax = tonumber(ARGV[4]), tonumber(ARGV[5])
local rate, burst = tonumber(ARGV[6]), tonumber(ARGV[7])
local function weight_of(m) return tonumber(string.match(m, ':(%d+)$')) or 0 end
local weight = weight_of(ARGV[2])
local n = 0
if KEYS[1] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  n = redis.call('ZCARD', KEYS[1])
  if tmax > 0 and n >= tmax then return {1, n} end
end
if KEYS[2] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local k = redis.call('ZCARD', KEYS[2])
  if kmax > 0 and k >= kmax then return {2, k} end
end
for i = 4, #KEYS do
  local cmax, wmax = tonumber(ARGV[i * 2]), tonumber(ARGV[i * 2 + 1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  if cmax > 0 then
    local c = redis.call('ZCARD', KEYS[i])
    if c >= cmax then return {i, c} end
  end
  if wmax > 0 then
    local total = 0
    for _, m in ipairs(redis.call('ZRANGE', KEYS[i], 0, -1)) do total = total + weight_of(m) end
    if total > 0 and total + weight > wmax then return {100 + i, total} end
  end
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
local deadline = tonumber(ARGV[3])
for i = 1, #KEYS do
  if i ~= 3 and KEYS[i] ~= '' then
    redis.call('ZADD', KEYS[i], deadline, ARGV[2])
    if redis.call('PTTL', KEYS[i]) < deadline - now then
      redis.call('PEXPIREAT', KEYS[i], deadline)
    end
  end
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


@dataclass(frozen=True)
class Scope:
    """One per-kind pool a lease also goes into: its Redis set, the limit's name in a
    429 (``limit``), what it is counted per (for the message), and its maxima."""

    key: str
    limit: str
    per: str
    max_count: int
    max_weight: int = 0
    weight_unit: str = ""


def _unit(kind: str) -> str:
    return {"exec": "short execs", "long_exec": "long execs", "file": "file transfers"}[kind]


def _scopes(kind: str, tenant_id: str, sandbox_key: str | None) -> list[Scope]:
    """The installation's per-kind pools (settings; 0 = unlimited, left out) for a
    ``kind`` of operation: ``exec`` (short), ``long_exec`` or ``file``. The sandbox's
    set is keyed by tenant as well: a key is never shared across teams."""
    s = settings
    if kind == "exec":
        rows = [
            ("sandbox", s.HEDGEROW_EXEC_MAX_PER_SANDBOX, 0, "execs_per_sandbox", ""),
            ("installation", s.HEDGEROW_EXEC_MAX_PER_INSTALLATION, 0, "execs_per_installation", ""),
        ]
    elif kind == "long_exec":
        rows = [
            ("sandbox", s.HEDGEROW_LONG_EXEC_MAX_PER_SANDBOX, 0, "long_execs_per_sandbox", ""),
            (
                "tenant",
                s.HEDGEROW_LONG_EXEC_MAX_PER_TENANT,
                s.HEDGEROW_LONG_EXEC_SECONDS_PER_TENANT,
                "long_execs_per_tenant",
                "s",
            ),
            (
                "installation",
                s.HEDGEROW_LONG_EXEC_MAX_PER_INSTALLATION,
                s.HEDGEROW_LONG_EXEC_SECONDS_PER_INSTALLATION,
                "long_execs_per_installation",
                "s",
            ),
        ]
    else:
        rows = [
            ("sandbox", s.HEDGEROW_FILE_TRANSFERS_PER_SANDBOX, 0, "file_transfers_per_sandbox", ""),
            (
                "tenant",
                s.HEDGEROW_FILE_TRANSFERS_PER_TENANT,
                s.HEDGEROW_FILE_BYTES_PER_TENANT,
                "file_transfers_per_tenant",
                "bytes",
            ),
            (
                "installation",
                s.HEDGEROW_FILE_TRANSFERS_PER_INSTALLATION,
                s.HEDGEROW_FILE_BYTES_PER_INSTALLATION,
                "file_transfers_per_installation",
                "bytes",
            ),
        ]
    where = {
        "sandbox": (kind, "sbx", tenant_id, sandbox_key or ""),
        "tenant": (kind, "tenant", tenant_id),
        "installation": (kind, "all"),
    }
    out = []
    for per, count, weight, limit, unit in rows:
        if per == "sandbox" and not sandbox_key:
            continue
        if int(count) > 0 or int(weight) > 0:
            out.append(Scope(_key(*where[per]), limit, per, int(count), int(weight), unit))
    return out


def _all_scope_keys(tenant_id: str, sandbox_key: str | None, kinds: tuple[str, ...]) -> list[str]:
    """Every per-kind set a lease of these kinds may sit in, whatever the settings say
    now (a release must find it even if the limits changed since the admission)."""
    keys = []
    for kind in kinds:
        if sandbox_key:
            keys.append(_key(kind, "sbx", tenant_id, sandbox_key))
        keys += [_key(kind, "tenant", tenant_id), _key(kind, "all")]
    return keys


def exec_kind(timeout_s: float) -> str:
    """``long_exec`` when the exec may run longer than HEDGEROW_EXEC_LONG_AFTER_S."""
    return "long_exec" if timeout_s > float(settings.HEDGEROW_EXEC_LONG_AFTER_S) else "exec"


def _lease_id(weight: int) -> str:
    return f"{uuid.uuid4().hex}:{max(0, int(weight))}"


def _refusal(
    code: int,
    current: int,
    *,
    scopes: list[Scope],
    tmax: int,
    kmax: int,
    rate: float,
    burst: int,
    limit_name: str,
    unit: str,
    weight: int,
) -> ApiError:
    if code == 1:
        return limit_error(
            QuotaExceeded,
            limit=limit_name,
            value=tmax,
            current=current,
            message=f"this team has its maximum of {tmax} concurrent {unit} running",
            retry=1,
        )
    if code == 2:
        return limit_error(
            QuotaExceeded,
            limit=f"key_{limit_name}",
            value=kmax,
            current=current,
            message=f"this API key has its maximum of {kmax} concurrent {unit} running",
            retry=1,
        )
    if code == 3:
        return limit_error(
            QuotaExceeded,
            limit="exec_rate_per_s",
            value=rate,
            current=None,
            message=f"exec rate over this team's {rate:g}/s (burst {burst})",
            retry=max(1, math.ceil(current / 1000)),
        )
    by_weight = code > 100
    scope = scopes[(code - 100 if by_weight else code) - 4]
    if by_weight:
        name = scope.limit.replace("long_execs", "long_exec_seconds").replace(
            "file_transfers", "file_bytes"
        )
        return limit_error(
            QuotaExceeded,
            limit=name,
            value=scope.max_weight,
            current=current,
            message=f"{weight} more {scope.weight_unit} of {_unit_of(scope)} in flight would "
            f"exceed this {scope.per}'s limit of {scope.max_weight} ({current} in flight)",
            retry=1,
        )
    return limit_error(
        QuotaExceeded,
        limit=scope.limit,
        value=scope.max_count,
        current=current,
        message=f"this {scope.per} has its maximum of {scope.max_count} concurrent "
        f"{_unit_of(scope)} running",
        retry=1,
    )


def _unit_of(scope: Scope) -> str:
    return _unit(scope.key.removeprefix(settings.REDIS_KEY_PREFIX + "quota:").split(":")[0])


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
    scopes: list[Scope],
    tenant_set: str | None,
) -> None:
    now = _now_ms()
    keys = [
        tenant_set or "",
        _key(tenant_set_kind(kind), tenant_id, "key", key_id) if key_id and kmax else "",
        _key("bucket", tenant_set_kind(kind), tenant_id),
        *(scope.key for scope in scopes),
    ]
    args: list[Any] = [now, lease, now + int(hold_s * 1000), tmax, kmax, rate, burst]
    for scope in scopes:
        args += [scope.max_count, scope.max_weight]
    try:
        code, current = _script(_ACQUIRE)(keys=keys, args=args)
    except redis.RedisError:
        return  # fail open: a Redis hiccup must not take exec down; Postgres limits hold
    if code == 0:
        return
    raise _refusal(
        int(code),
        int(current),
        scopes=scopes,
        tmax=tmax,
        kmax=kmax,
        rate=rate,
        burst=burst,
        limit_name=limit_name,
        unit="exec sessions" if kind != "file" else "file transfers",
        weight=int(lease.rsplit(":", 1)[1]),
    )


def tenant_set_kind(kind: str) -> str:
    """Short and long execs share the tenant's exec quota (``max_concurrent_execs``,
    per key, the rate): the per-kind pools come on top of it."""
    return "exec" if kind in ("exec", "long_exec") else kind


def _release(keys: list[str], lease: str) -> None:
    try:
        pipe = redis_client().pipeline(transaction=False)
        for key in keys:
            pipe.zrem(key, lease)
        pipe.execute()
    except redis.RedisError:
        pass  # the lease expires at its deadline


def _exec_release_keys(
    tenant_id: str, api_key_id: str | None, sandbox_key: str | None
) -> list[str]:
    keys = [_key("exec", tenant_id)]
    if api_key_id:
        keys.append(_key("exec", tenant_id, "key", api_key_id))
    return keys + _all_scope_keys(tenant_id, sandbox_key, ("exec", "long_exec"))


def exec_admit(
    *, tenant_id: str, api_key_id: str | None, timeout_s: float, sandbox_key: str | None = None
) -> str:
    """Takes an exec slot and a rate token or raises 429 naming the limit. Returns the
    lease id for ``exec_release``. The lease outlives the command's own timeout. With
    ``sandbox_key`` (the sandbox's external id) the per-sandbox pool of the exec's kind
    (short or long, ``exec_kind``) counts it too; the installation's pools always do."""
    limits = hot_limits(tenant_id)
    kmax = limits.key_max_execs.get(api_key_id or "", 0)
    kind = exec_kind(timeout_s)
    lease = _lease_id(math.ceil(timeout_s) if kind == "long_exec" else 0)
    _acquire(
        kind=kind,
        tenant_id=tenant_id,
        key_id=api_key_id,
        lease=lease,
        hold_s=timeout_s + 60,
        tmax=limits.max_execs,
        kmax=kmax,
        rate=limits.exec_rate,
        burst=limits.exec_burst,
        limit_name="max_concurrent_execs",
        scopes=_scopes(kind, tenant_id, sandbox_key),
        tenant_set=_key("exec", tenant_id),
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
    *,
    limits: HotLimits,
    tenant_id: str,
    api_key_id: str | None,
    timeout_s: float,
    sandbox_key: str | None = None,
) -> ExecAdmitPlan:
    """The same admission as ``exec_admit`` (same keys, lease and limits), unexecuted."""
    kmax = limits.key_max_execs.get(api_key_id or "", 0)
    kind = exec_kind(timeout_s)
    lease = _lease_id(math.ceil(timeout_s) if kind == "long_exec" else 0)
    scopes = _scopes(kind, tenant_id, sandbox_key)
    now = _now_ms()
    keys = [
        _key("exec", tenant_id),
        _key("exec", tenant_id, "key", api_key_id) if api_key_id and kmax else "",
        _key("bucket", "exec", tenant_id),
        *(scope.key for scope in scopes),
    ]
    deadline = now + int((timeout_s + 60) * 1000)
    args: list[Any] = [now, lease, deadline, limits.max_execs, kmax, limits.exec_rate]
    args.append(limits.exec_burst)
    for scope in scopes:
        args += [scope.max_count, scope.max_weight]
    release = [_key("exec", tenant_id)]
    if api_key_id:
        release.append(_key("exec", tenant_id, "key", api_key_id))
    release += [scope.key for scope in scopes]
    return ExecAdmitPlan(_ACQUIRE, keys, args, lease, release)


def exec_release(
    *, tenant_id: str, api_key_id: str | None, lease: str, sandbox_key: str | None = None
) -> None:
    _release(_exec_release_keys(tenant_id, api_key_id, sandbox_key), lease)


@dataclass(frozen=True)
class ExecLease:
    tenant_id: str
    api_key_id: str | None
    lease: str
    sandbox_key: str | None = None

    def release(self) -> None:
        exec_release(
            tenant_id=self.tenant_id,
            api_key_id=self.api_key_id,
            lease=self.lease,
            sandbox_key=self.sandbox_key,
        )


def exec_admit_operation(
    *,
    principal: Any,
    operation: Any,
    is_new: bool,
    timeout_s: float,
    sandbox_key: str | None = None,
) -> ExecLease:
    """The exec hot path's one call: takes a slot and a rate token for ``operation`` or
    raises 429. A refused new operation is removed, so nothing ran and nothing is left
    (a retry with the same operation id starts clean). Call ``.release()`` when done."""
    tenant_id = str(operation.tenant_id)
    key_id = str(principal.api_key.pk) if getattr(principal, "api_key", None) else None
    try:
        lease = exec_admit(
            tenant_id=tenant_id, api_key_id=key_id, timeout_s=timeout_s, sandbox_key=sandbox_key
        )
    except QuotaExceeded:
        if is_new:
            type(operation).objects.filter(pk=operation.pk).delete()
        raise
    return ExecLease(tenant_id=tenant_id, api_key_id=key_id, lease=lease, sandbox_key=sandbox_key)


@contextmanager
def exec_slot(*, principal: Any, sandbox: Any, timeout_s: float) -> Iterator[None]:
    """``with exec_slot(...)`` around one exec: admit (429s), run, always release."""
    tenant_id = str(sandbox.tenant_id)
    key_id = str(principal.api_key.pk) if getattr(principal, "api_key", None) else None
    sandbox_key = str(sandbox.external_id)
    lease = exec_admit(
        tenant_id=tenant_id, api_key_id=key_id, timeout_s=timeout_s, sandbox_key=sandbox_key
    )
    try:
        yield
    finally:
        exec_release(tenant_id=tenant_id, api_key_id=key_id, lease=lease, sandbox_key=sandbox_key)


def transfer_admit(*, tenant_id: str, sandbox_key: str, nbytes: int) -> str:
    """Takes a file-transfer slot (an upload or a download, a file or a tree) in the
    sandbox's, the tenant's and the installation's pools, weighing ``nbytes`` (0 when
    unknown) against their bytes-in-flight limits, or raises 429 naming the limit.
    Returns the lease for ``transfer_release``; it lapses by itself after
    HEDGEROW_FILE_TRANSFER_HOLD_S should the process die mid-transfer."""
    lease = _lease_id(nbytes)
    _acquire(
        kind="file",
        tenant_id=tenant_id,
        key_id=None,
        lease=lease,
        hold_s=TRANSFER_HOLD_S,
        tmax=0,
        kmax=0,
        rate=0,
        burst=0,
        limit_name="file_transfers",
        scopes=_scopes("file", tenant_id, sandbox_key),
        tenant_set=None,
    )
    return lease


def transfer_release(*, tenant_id: str, sandbox_key: str, lease: str) -> None:
    _release(_all_scope_keys(tenant_id, sandbox_key, ("file",)), lease)


def in_flight(kind: str, tenant_id: str | None, sandbox_key: str | None = None) -> int:
    """Leases live now in one per-kind pool: the sandbox's (``sandbox_key``), else the
    tenant's, else (``tenant_id`` None) the installation's. Only pools with a limit
    set are kept, so an unlimited one reads 0.

    A Redis error is raised, not read as 0: this is what tests assert "the slot was
    given back" (== 0) and "the slot is held" (== 1) with, and an error that read as an
    empty pool made the first pass for nothing and the second fail without saying why
    (a flaky ``test_downloads_stream_past_django_and_give_their_slot_back``)."""
    if sandbox_key:
        key = _key(kind, "sbx", tenant_id or "", sandbox_key)
    elif tenant_id:
        key = _key(kind, "tenant", tenant_id)
    else:
        key = _key(kind, "all")
    count: int = redis_client().zcount(key, _now_ms(), "+inf")  # type: ignore[assignment]
    return int(count)


# A transfer's lease: the agent call's own timeout (600 s) and a minute to spare.
TRANSFER_HOLD_S = 660.0


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
