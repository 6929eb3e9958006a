"""What admission compares the limits with: live sandboxes (count, cpu, memory, per key
and in the cluster), the admission queue, kept snapshot bytes. Counted from Postgres
under the tenant's quota lock (``apps.billing.quotas.quota_lock_for``), so concurrent
creates of one tenant are decided one at a time against committed rows.

The limits themselves, the lock, the request and budget checks and the typed refusals
are billing's (``apps.billing.quotas``, ``apps.billing.errors``). Billing's own quota
report reads the use through ``quota_use``, which ``apps.py`` registers into it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection

from apps.billing.errors import QuotaExceeded, limit_error
from apps.billing.models import TenantQuota
from apps.billing.quotas import Ask, QuotaUse, key_sandbox_limit, quota_lock
from apps.core.errors import ApiError
from apps.sandboxes.backends import address_capacity
from apps.sandboxes.metering.storage import snapshot_bytes_in_use
from apps.sandboxes.models import LIVE_STATES, Sandbox, State, WarmMember
from apps.tenancy.models import Tenant


@dataclass(frozen=True)
class TenantUse:
    """A tenant's live sandboxes (count, cpu, memory) and how many wait in the queue."""

    live: int
    cpu_millis: int
    memory_mib: int
    queued: int
    # Asked with ``cluster=True`` (a cluster cap is set): live sandboxes of every tenant,
    # and warm pool members (each holds an address of the instance's subnet too).
    cluster_live: int | None = None
    warm_members: int | None = None


# Written out once: the ORM spent ~1.4 ms of CPU compiling this aggregate on every
# create (py-spy, docs/benchmarks.md). A test holds it to the ORM's answer.
_TENANT_USE_SQL = """SELECT COUNT(*) FILTER (WHERE state = ANY(%(live)s)),
       SUM(cpu_millis) FILTER (WHERE state = ANY(%(live)s)),
       SUM(memory_mib) FILTER (WHERE state = ANY(%(live)s)),
       COUNT(*) FILTER (WHERE state = %(queued)s)
  FROM sandboxes_sandbox
 WHERE tenant_id = %(tenant)s AND state = ANY(%(counted)s)
"""


# With a cluster cap: the same, and the cluster's live sandboxes and warm members, read
# in the same statement (after the cluster lock, so in the same snapshot as the rest).
_TENANT_AND_CLUSTER_USE_SQL = f"""SELECT t.*,
       (SELECT COUNT(*) FROM sandboxes_sandbox WHERE state = ANY(%(live)s)),
       (SELECT COUNT(*) FROM "{WarmMember._meta.db_table}")
  FROM ({_TENANT_USE_SQL}) t
"""  # noqa: S608 - identifiers from the model's metadata; values are parameters


def tenant_use(*, tenant_id: Any, cluster: bool = False) -> TenantUse:
    """One statement; call with the quota row locked for a decision that must be exact
    (and, with ``cluster``, the cluster lock: ``quota_lock_for(cluster=True)``)."""
    live = [str(s) for s in LIVE_STATES]
    with connection.cursor() as cursor:
        cursor.execute(
            _TENANT_AND_CLUSTER_USE_SQL if cluster else _TENANT_USE_SQL,
            {
                "live": live,
                "queued": str(State.QUEUED),
                "tenant": str(tenant_id),
                "counted": [*live, str(State.QUEUED)],
            },
        )
        row = cursor.fetchone()
    n, cpu, mem, queued = row[:4]
    return TenantUse(
        live=n or 0,
        cpu_millis=cpu or 0,
        memory_mib=mem or 0,
        queued=queued or 0,
        cluster_live=row[4] if cluster else None,
        warm_members=row[5] if cluster else None,
    )


def cluster_capped() -> bool:
    """A cap on the whole installation applies: ``HEDGEROW_MAX_LIVE_SANDBOXES``, or the
    backend's addresses (the local backend's subnet, ``address_capacity``). Admission
    then takes the cluster lock and counts every tenant's sandboxes."""
    return bool(settings.HEDGEROW_MAX_LIVE_SANDBOXES) or address_capacity() is not None


CLUSTER_LIMITS = frozenset({"cluster_live_sandboxes", "cluster_addresses"})


def _cluster_shortfall(*, use: TenantUse | None, count: int, more: str) -> ApiError | None:
    if not cluster_capped():
        return None
    if use is None or use.cluster_live is None or use.warm_members is None:
        live = Sandbox.objects.filter(state__in=LIVE_STATES).count()
        warm = WarmMember.objects.count()
    else:
        live, warm = use.cluster_live, use.warm_members
    cluster_cap = settings.HEDGEROW_MAX_LIVE_SANDBOXES
    if cluster_cap and live + count > cluster_cap:
        return limit_error(
            QuotaExceeded,
            limit="cluster_live_sandboxes",
            value=cluster_cap,
            current=live,
            message=f"the cluster runs its maximum of {cluster_cap} live sandboxes{more}",
        )
    addresses = address_capacity()
    if addresses is not None and live + warm + count > addresses:
        return limit_error(
            QuotaExceeded,
            limit="cluster_addresses",
            value=addresses,
            current=live + warm,
            message=f"every address of the instance's subnet is taken ({live} live "
            f"sandboxes, {warm} warm pool members; at most {addresses}{more}): "
            'docs/operations.md "Density"',
        )
    return None


class _Unread(enum.Enum):
    KEY_LIMIT = "read the key's limit here"


def capacity_shortfall(
    *,
    quota: TenantQuota,
    ask: Ask,
    use: TenantUse | None = None,
    key_max_sandboxes: int | None | _Unread = _Unread.KEY_LIMIT,
    count: int = 1,
) -> ApiError | None:
    """The first limit one more sandbox (``count`` more, each of ``ask``'s shape: a
    fork's children, admitted as a whole) would break right now, or None. Counts live
    sandboxes from the database (or takes ``use``, read under the same lock); call with
    the quota row locked. ``key_max_sandboxes``: the asking key's limit as
    ``quota_lock_for`` read it (None: none); by default it is read here."""
    more = "" if count == 1 else f" ({count} more sandboxes)"
    if use is None:
        use = tenant_use(tenant_id=quota.tenant_id, cluster=cluster_capped())
    cluster = _cluster_shortfall(use=use, count=count, more=more)
    if cluster is not None:
        return cluster
    live_n, cpu, mem = use.live, use.cpu_millis, use.memory_mib
    ask_cpu, ask_mem = ask.cpu_millis * count, ask.memory_mib * count
    cap = quota.max_concurrent_sandboxes
    if cap is not None and live_n + count > cap:
        return limit_error(
            QuotaExceeded,
            limit="max_concurrent_sandboxes",
            value=quota.max_concurrent_sandboxes,
            current=live_n,
            message=f"this team runs its maximum of {quota.max_concurrent_sandboxes} "
            f"concurrent sandboxes{more}",
        )
    if quota.max_cpu_millis is not None and cpu + ask_cpu > quota.max_cpu_millis:
        return limit_error(
            QuotaExceeded,
            limit="max_cpu_millis",
            value=quota.max_cpu_millis,
            current=cpu,
            message=f"{ask_cpu}m more cpu would exceed the team's {quota.max_cpu_millis}m "
            f"({cpu}m in use)",
        )
    if quota.max_memory_mib is not None and mem + ask_mem > quota.max_memory_mib:
        return limit_error(
            QuotaExceeded,
            limit="max_memory_mib",
            value=quota.max_memory_mib,
            current=mem,
            message=f"{ask_mem}Mi more memory would exceed the team's "
            f"{quota.max_memory_mib}Mi ({mem}Mi in use)",
        )
    if isinstance(key_max_sandboxes, _Unread):
        key_max_sandboxes = key_sandbox_limit(actor=ask.actor, tenant_id=quota.tenant_id)
    if key_max_sandboxes is not None:
        mine = Sandbox.objects.filter(
            tenant_id=quota.tenant_id, state__in=LIVE_STATES, created_by=ask.actor
        ).count()
        if mine + count > key_max_sandboxes:
            return limit_error(
                QuotaExceeded,
                limit="key_max_concurrent_sandboxes",
                value=key_max_sandboxes,
                current=mine,
                message=f"this API key runs its maximum of "
                f"{key_max_sandboxes} concurrent sandboxes{more}",
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


def quota_use(tenant: Tenant) -> QuotaUse:
    """A tenant's use for billing's quota report (``apps.billing.quotas.quota_usage``;
    registered in ``apps.py``): its live sandboxes and queue in one statement, and the
    bytes its snapshots keep."""
    use = tenant_use(tenant_id=tenant.pk)
    return QuotaUse(
        concurrent_sandboxes=use.live,
        cpu_millis=use.cpu_millis,
        memory_mib=use.memory_mib,
        queued=use.queued,
        snapshot_bytes=snapshot_bytes_in_use(tenant_id=tenant.pk),
    )
