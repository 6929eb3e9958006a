"""Sandbox admission's limits: per-tenant, per-key and cluster, enforced atomically.

Billing owns the limits (the quota row and its lock, a key's limit, the checks that
need no count: a request bigger than the quota, the budget) and the typed refusals
(``errors.py``); the sandboxes app counts what they are compared with and acts on the
answer (``apps.sandboxes.admission``). Billing never imports sandboxes: the quota
report reads the use through a reader the sandboxes app registers
(``register_use_reader``).

Every admission decision runs inside the create (or queue-admit) transaction with the
tenant's quota row locked (``select_for_update``), after the cluster lock when a
cluster cap is set. Use is counted from Postgres under that lock, so concurrent
creates of one tenant are decided one at a time against committed rows — a burst of
200 creates against a limit of 50 admits exactly 50 — and nothing needs reconciling
after a restart: the database is the counter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from apps.billing.errors import BudgetExhausted, QuotaForbidden, limit_error
from apps.billing.limits import limits_current
from apps.billing.models import ApiKeyLimits, TenantQuota
from apps.billing.pricing import money
from apps.billing.reports import month_to_date_cost
from apps.core.dbrows import instance_from_row, select_list
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


def quota_lock_for(
    *, tenant: Tenant, actor: str, cluster: bool | None = None
) -> tuple[TenantQuota, int | None]:
    """``quota_lock``, and the sandbox limit of ``actor``'s API key (None: no limit, or
    not a key), read with the lock in one statement. ``cluster``: take the cluster lock
    first (a cap on the whole installation is checked; default: when
    ``HEDGEROW_MAX_LIVE_SANDBOXES`` is set — admission also asks for it when the
    backend's addresses cap the installation)."""
    if cluster is None:
        cluster = bool(settings.HEDGEROW_MAX_LIVE_SANDBOXES)
    if cluster:
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
    """Refuses a new sandbox (or a queued one's admission) once month-to-date spend has
    reached staff's ``monthly_budget`` or the owners' own ``team_budget``, naming the
    budget in the way. Running sandboxes are never touched by it."""
    if quota.monthly_budget is None and quota.team_budget is None:
        return
    # from the daily roll-up (finished days, today's partial one) as the pages show it:
    # this runs under the tenant's quota row lock on every create, and a walk of every
    # record of the month (``tenant_month_cost``) grew with the month's history
    spent = month_to_date_cost(tenant=quota.tenant)
    if quota.monthly_budget is not None and spent >= quota.monthly_budget:
        raise limit_error(
            BudgetExhausted,
            limit="monthly_budget",
            value=str(quota.monthly_budget),
            current=str(money(spent)),
            message=f"this team has spent {money(spent)} of its monthly budget of "
            f"{quota.monthly_budget}; new sandboxes start next month or when staff raise it",
        )
    if quota.team_budget is not None and spent >= quota.team_budget:
        raise limit_error(
            BudgetExhausted,
            limit="team_budget",
            value=str(quota.team_budget),
            current=str(money(spent)),
            message=f"this team has spent {money(spent)} of the monthly budget of "
            f"{quota.team_budget} its owners set; new sandboxes start next month or when "
            "an owner raises it",
        )


def key_sandbox_limit(*, actor: str, tenant_id: Any) -> int | None:
    """The concurrent-sandbox limit of ``actor``'s API key (None: no limit, or not a key)."""
    if not actor.startswith("key:"):
        return None
    limits = ApiKeyLimits.objects.filter(
        api_key__tenant_id=tenant_id, api_key__prefix=actor[4:]
    ).first()
    return limits.max_concurrent_sandboxes if limits else None


@dataclass(frozen=True)
class QuotaUse:
    """What a tenant uses of the limits that count sandboxes and kept state."""

    concurrent_sandboxes: int
    cpu_millis: int
    memory_mib: int
    queued: int
    snapshot_bytes: int


_use_reader: Callable[[Tenant], QuotaUse] | None = None


def register_use_reader(reader: Callable[[Tenant], QuotaUse]) -> None:
    """The sandboxes app (a floor up) tells billing how to count a tenant's use; called
    from its ``AppConfig.ready``. A registry, not an import: billing never imports it."""
    global _use_reader
    _use_reader = reader


def _quota_use(tenant: Tenant) -> QuotaUse:
    if _use_reader is None:
        raise ImproperlyConfigured("no quota use reader registered (apps.sandboxes installed?)")
    return _use_reader(tenant)


def quota_usage(
    *, tenant: Tenant, spent: Decimal | None = None, quota: TenantQuota | None = None
) -> dict[str, Any]:
    """Limits next to current use, for the API and the quota bars. ``spent``: the month
    to date when the caller has it already (the usage page: from its report), and
    ``quota`` the tenant's quota row when it read it."""
    quota = quota or quota_get(tenant=tenant)
    use = _quota_use(tenant)
    hot = limits_current(tenant_id=str(tenant.pk))
    # the month from the daily roll-up: every dashboard page shows these bars
    if spent is None:
        spent = month_to_date_cost(tenant=tenant)
    budget: Decimal | None = quota.monthly_budget
    return {
        "concurrent_sandboxes": {
            "limit": quota.max_concurrent_sandboxes,
            "current": use.concurrent_sandboxes,
        },
        "cpu_millis": {"limit": quota.max_cpu_millis, "current": use.cpu_millis},
        "memory_mib": {"limit": quota.max_memory_mib, "current": use.memory_mib},
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
        "team_budget": {
            "limit": str(quota.team_budget) if quota.team_budget is not None else None,
            "current": str(money(spent)),
        },
        "snapshot_bytes": {
            "limit": quota.max_snapshot_bytes,
            "current": use.snapshot_bytes,
        },
        "queued": {"limit": quota.max_queued, "current": use.queued},
        "queue_by_default": quota.queue_by_default,
    }
