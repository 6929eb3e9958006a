"""Sandbox admission: per-tenant, per-key and cluster limits, enforced atomically.

Every admission decision runs inside the create (or queue-admit) transaction with the
tenant's quota row locked (``select_for_update``), after the cluster lock when a
cluster cap is set. Use is counted from Postgres under that lock, so concurrent
creates of one tenant are decided one at a time against committed rows — a burst of
200 creates against a limit of 50 admits exactly 50 — and nothing needs reconciling
after a restart: the database is the counter.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count, Sum

from apps.billing.errors import BudgetExhausted, QuotaExceeded, QuotaForbidden, limit_error
from apps.billing.limits import limits_current
from apps.billing.models import ApiKeyLimits, TenantQuota
from apps.billing.pricing import money
from apps.billing.storage import snapshot_bytes_in_use
from apps.billing.usage import tenant_month_cost
from apps.core.dbrows import instance_from_row, select_list
from apps.core.errors import ApiError
from apps.sandboxes.models import LIVE_STATES, Sandbox, State
from apps.tenancy.models import ApiKey, Tenant

# Any constant unique to this lock; pg advisory locks are per database.
CLUSTER_LOCK_KEY = 0x48454447  # "HEDG"


def quota_get(*, tenant: Tenant) -> TenantQuota:
    """The tenant's quota row, created with defaults on first use (race-free)."""
    quota = TenantQuota.objects.filter(tenant=tenant).first()
    if quota is None:
        TenantQuota.objects.bulk_create([TenantQuota(tenant=tenant)], ignore_conflicts=True)
        quota = TenantQuota.objects.get(tenant=tenant)
    return quota


def quota_lock(*, tenant: Tenant) -> TenantQuota:
    """Locks the cluster (if capped) and then the tenant's quota row, always in that
    order so two admissions can never deadlock. Must run inside a transaction."""
    return quota_lock_for(tenant=tenant, actor="")[0]


@functools.cache
def _quota_lock_sql() -> str:
    """The quota row, locked, and the calling key's sandbox limit, in one statement.

    Written out once: the ORM spent ~1.5 ms of CPU compiling the ``select_for_update``
    and ~0.8 ms the key-limits join on every create (py-spy, docs/benchmarks.md). The
    key-limit subquery reads the statement's snapshot, taken before the lock wait;
    that is fine for a limit (a setting), unlike the use counted under the lock, which
    must be a statement of its own (``tenant_use``). A test holds it to the ORM's read.
    """
    quotas, limits, keys = TenantQuota._meta, ApiKeyLimits._meta, ApiKey._meta
    # Identifiers only from the models' own metadata; values are parameters.
    return f"""SELECT {select_list(TenantQuota)},
       (SELECT kl.max_concurrent_sandboxes
          FROM "{limits.db_table}" kl JOIN "{keys.db_table}" k ON k.id = kl.api_key_id
         WHERE k.tenant_id = "{quotas.db_table}".tenant_id AND k.prefix = %(prefix)s
         ORDER BY kl.id LIMIT 1)
  FROM "{quotas.db_table}"
 WHERE "{quotas.db_table}".tenant_id = %(tenant)s
   FOR UPDATE OF "{quotas.db_table}"
"""  # noqa: S608


def quota_lock_for(*, tenant: Tenant, actor: str) -> tuple[TenantQuota, int | None]:
    """``quota_lock``, and the sandbox limit of ``actor``'s API key (None: no limit, or
    not a key), read with the lock in one statement."""
    if settings.HEDGEROW_MAX_LIVE_SANDBOXES:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CLUSTER_LOCK_KEY])
    sql = _quota_lock_sql()
    params = {"tenant": str(tenant.pk), "prefix": actor[4:] if actor.startswith("key:") else None}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
        if row is None:  # first use: create it (race-free), then lock it
            quota_get(tenant=tenant)
            cursor.execute(sql, params)
            row = cursor.fetchone()
    if row is None:  # the tenant is gone (deleted meanwhile)
        raise TenantQuota.DoesNotExist(f"no quota row for tenant {tenant.pk}")
    quota = instance_from_row(TenantQuota, row)
    # The caller's tenant, so reading quota.tenant (budget, key limits) costs no query.
    quota.tenant = tenant
    key_max: int | None = row[-1]
    return quota, key_max


@dataclass(frozen=True)
class Ask:
    """What one sandbox needs from admission."""

    cpu_millis: int
    memory_mib: int
    ttl_seconds: int
    actor: str


def check_request_fits(*, quota: TenantQuota, ask: Ask) -> None:
    """Limits that waiting cannot fix: a single sandbox bigger than the whole quota."""
    if quota.max_lifetime_s is not None and ask.ttl_seconds > quota.max_lifetime_s:
        raise limit_error(
            QuotaForbidden,
            limit="max_lifetime_s",
            value=quota.max_lifetime_s,
            current=ask.ttl_seconds,
            message=f"ttl_seconds {ask.ttl_seconds} exceeds this team's maximum sandbox "
            f"lifetime of {quota.max_lifetime_s}s",
        )
    if quota.max_cpu_millis is not None and ask.cpu_millis > quota.max_cpu_millis:
        raise limit_error(
            QuotaForbidden,
            limit="max_cpu_millis",
            value=quota.max_cpu_millis,
            current=ask.cpu_millis,
            message=f"one sandbox of {ask.cpu_millis}m cpu is over the team's total of "
            f"{quota.max_cpu_millis}m",
        )
    if quota.max_memory_mib is not None and ask.memory_mib > quota.max_memory_mib:
        raise limit_error(
            QuotaForbidden,
            limit="max_memory_mib",
            value=quota.max_memory_mib,
            current=ask.memory_mib,
            message=f"one sandbox of {ask.memory_mib}Mi is over the team's total of "
            f"{quota.max_memory_mib}Mi",
        )


def check_budget(*, quota: TenantQuota) -> None:
    if quota.monthly_budget is None:
        return
    spent = tenant_month_cost(tenant=quota.tenant)
    if spent >= quota.monthly_budget:
        raise limit_error(
            BudgetExhausted,
            limit="monthly_budget",
            value=str(quota.monthly_budget),
            current=str(money(spent)),
            message=f"this team has spent {money(spent)} of its monthly budget of "
            f"{quota.monthly_budget}; new sandboxes start next month or when staff raise it",
        )


def _key_limits(actor: str, tenant_id: Any) -> ApiKeyLimits | None:
    if not actor.startswith("key:"):
        return None
    return ApiKeyLimits.objects.filter(
        api_key__tenant_id=tenant_id, api_key__prefix=actor[4:]
    ).first()


@dataclass(frozen=True)
class TenantUse:
    """A tenant's live sandboxes (count, cpu, memory) and how many wait in the queue."""

    live: int
    cpu_millis: int
    memory_mib: int
    queued: int


# Written out once: the ORM spent ~1.4 ms of CPU compiling this aggregate on every
# create (py-spy, docs/benchmarks.md). A test holds it to the ORM's answer.
_TENANT_USE_SQL = """SELECT COUNT(*) FILTER (WHERE state = ANY(%(live)s)),
       SUM(cpu_millis) FILTER (WHERE state = ANY(%(live)s)),
       SUM(memory_mib) FILTER (WHERE state = ANY(%(live)s)),
       COUNT(*) FILTER (WHERE state = %(queued)s)
  FROM sandboxes_sandbox
 WHERE tenant_id = %(tenant)s AND state = ANY(%(counted)s)
"""


def tenant_use(*, tenant_id: Any) -> TenantUse:
    """One statement; call with the quota row locked for a decision that must be exact."""
    live = [str(s) for s in LIVE_STATES]
    with connection.cursor() as cursor:
        cursor.execute(
            _TENANT_USE_SQL,
            {
                "live": live,
                "queued": str(State.QUEUED),
                "tenant": str(tenant_id),
                "counted": [*live, str(State.QUEUED)],
            },
        )
        n, cpu, mem, queued = cursor.fetchone()
    return TenantUse(live=n or 0, cpu_millis=cpu or 0, memory_mib=mem or 0, queued=queued or 0)


class _Unread(enum.Enum):
    KEY_LIMIT = "read the key's limit here"


def capacity_shortfall(
    *,
    quota: TenantQuota,
    ask: Ask,
    use: TenantUse | None = None,
    key_max_sandboxes: int | None | _Unread = _Unread.KEY_LIMIT,
) -> ApiError | None:
    """The first limit one more sandbox would break right now, or None. Counts live
    sandboxes from the database (or takes ``use``, read under the same lock); call with
    the quota row locked. ``key_max_sandboxes``: the asking key's limit as
    ``quota_lock_for`` read it (None: none); by default it is read here."""
    cluster_cap = settings.HEDGEROW_MAX_LIVE_SANDBOXES
    if cluster_cap:
        live = Sandbox.objects.filter(state__in=LIVE_STATES).count()
        if live >= cluster_cap:
            return limit_error(
                QuotaExceeded,
                limit="cluster_live_sandboxes",
                value=cluster_cap,
                current=live,
                message=f"the cluster runs its maximum of {cluster_cap} live sandboxes",
            )
    if use is None:
        use = tenant_use(tenant_id=quota.tenant_id)
    count, cpu, mem = use.live, use.cpu_millis, use.memory_mib
    if quota.max_concurrent_sandboxes is not None and count >= quota.max_concurrent_sandboxes:
        return limit_error(
            QuotaExceeded,
            limit="max_concurrent_sandboxes",
            value=quota.max_concurrent_sandboxes,
            current=count,
            message=f"this team runs its maximum of {quota.max_concurrent_sandboxes} "
            "concurrent sandboxes",
        )
    if quota.max_cpu_millis is not None and cpu + ask.cpu_millis > quota.max_cpu_millis:
        return limit_error(
            QuotaExceeded,
            limit="max_cpu_millis",
            value=quota.max_cpu_millis,
            current=cpu,
            message=f"{ask.cpu_millis}m more cpu would exceed the team's {quota.max_cpu_millis}m "
            f"({cpu}m in use)",
        )
    if quota.max_memory_mib is not None and mem + ask.memory_mib > quota.max_memory_mib:
        return limit_error(
            QuotaExceeded,
            limit="max_memory_mib",
            value=quota.max_memory_mib,
            current=mem,
            message=f"{ask.memory_mib}Mi more memory would exceed the team's "
            f"{quota.max_memory_mib}Mi ({mem}Mi in use)",
        )
    if isinstance(key_max_sandboxes, _Unread):
        key_limits = _key_limits(ask.actor, quota.tenant_id)
        key_max_sandboxes = key_limits.max_concurrent_sandboxes if key_limits else None
    if key_max_sandboxes is not None:
        mine = Sandbox.objects.filter(
            tenant_id=quota.tenant_id, state__in=LIVE_STATES, created_by=ask.actor
        ).count()
        if mine >= key_max_sandboxes:
            return limit_error(
                QuotaExceeded,
                limit="key_max_concurrent_sandboxes",
                value=key_max_sandboxes,
                current=mine,
                message=f"this API key runs its maximum of "
                f"{key_max_sandboxes} concurrent sandboxes",
            )
    return None


def storage_shortfall(*, tenant: Tenant, adding: int = 0) -> ApiError | None:
    """The storage quota (``max_snapshot_bytes``: kept snapshots, paused sandboxes'
    state included) one more capture of ``adding`` bytes would break, or None. With
    ``adding=0`` (before a capture, its size unknown): refused once the use reached the
    limit. Locks the quota row: call inside a transaction."""
    quota = quota_lock(tenant=tenant)
    limit = quota.max_snapshot_bytes
    if limit is None:
        return None
    used = snapshot_bytes_in_use(tenant_id=tenant.pk)
    if (adding == 0 and used >= limit) or (adding > 0 and used + adding > limit):
        return limit_error(
            QuotaExceeded,
            limit="max_snapshot_bytes",
            value=limit,
            current=used,
            message=f"this team keeps {used} bytes of snapshots and paused sandboxes' state "
            f"of its {limit}"
            + (f"; this capture adds {adding}" if adding else "")
            + ": delete snapshots (or wait for their TTL) to make room",
            retry=60,
        )
    return None


def queued_count(*, tenant: Tenant) -> int:
    return Sandbox.objects.filter(tenant=tenant, state=State.QUEUED).count()


def quota_usage(*, tenant: Tenant) -> dict[str, Any]:
    """Limits next to current use, for the API and the quota bars."""
    quota = quota_get(tenant=tenant)
    use = Sandbox.objects.filter(tenant=tenant, state__in=LIVE_STATES).aggregate(
        n=Count("pk"), cpu=Sum("cpu_millis"), mem=Sum("memory_mib")
    )
    hot = limits_current(tenant_id=str(tenant.pk))
    spent = tenant_month_cost(tenant=tenant)
    budget: Decimal | None = quota.monthly_budget
    return {
        "concurrent_sandboxes": {"limit": quota.max_concurrent_sandboxes, "current": use["n"]},
        "cpu_millis": {"limit": quota.max_cpu_millis, "current": use["cpu"] or 0},
        "memory_mib": {"limit": quota.max_memory_mib, "current": use["mem"] or 0},
        "lifetime_s": {"limit": quota.max_lifetime_s, "current": None},
        "concurrent_execs": {"limit": quota.max_concurrent_execs, "current": hot["execs"]},
        "exec_rate_per_s": {"limit": quota.exec_rate_per_s, "burst": quota.exec_burst},
        "upload_bytes": {"limit": quota.max_upload_bytes, "current": None},
        "upload_bytes_per_day": {
            "limit": quota.upload_bytes_per_day,
            "current": hot["upload_bytes_today"],
        },
        "pty_sessions": {"limit": quota.max_pty_sessions, "current": hot["pty_sessions"]},
        "monthly_budget": {
            "limit": str(budget) if budget is not None else None,
            "current": str(money(spent)),
        },
        "snapshot_bytes": {
            "limit": quota.max_snapshot_bytes,
            "current": snapshot_bytes_in_use(tenant_id=tenant.pk),
        },
        "queued": {"limit": quota.max_queued, "current": queued_count(tenant=tenant)},
        "queue_by_default": quota.queue_by_default,
    }
