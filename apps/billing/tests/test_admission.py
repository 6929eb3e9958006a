"""Admission under concurrency: real threads, real Postgres, committed rows."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
from django.db import connection
from django.test import override_settings

from apps.billing.models import ApiKeyLimits, TenantQuota
from apps.billing.quotas import quota_get
from apps.core.errors import ApiError
from apps.sandboxes.models import LIVE_STATES, Sandbox, State
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create
from apps.tenancy.models import ApiKey

pytestmark = pytest.mark.timeout(120)


def _create(tenant, actor="key:test", **kw):
    try:
        sandbox, _ = sandbox_create(
            tenant=tenant,
            request=SandboxRequest(
                image="host", cpu_millis=kw.pop("cpu", 500), memory_mib=kw.pop("mem", 256), **kw
            ),
            idempotency_key=None,
            actor=actor,
        )
        return sandbox.state
    except ApiError as exc:
        return exc
    finally:
        if threading.current_thread() is not threading.main_thread():
            connection.close()  # each worker thread has its own connection


def _burst(fn, n, workers=16):
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


def test_it_admits_exactly_the_limit_out_of_a_concurrent_burst(
    transactional_db, make_tenant, no_enqueue
):
    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=50)
    results = _burst(lambda: _create(tenant), 200)
    admitted = [r for r in results if r == State.REQUESTED]
    refused = [r for r in results if isinstance(r, ApiError)]
    assert len(admitted) == 50 and len(refused) == 150
    error = refused[0]
    assert error.status_code == 429 and error.headers["Retry-After"]
    body = error.as_dict()["error"]
    assert body["code"] == "quota_exceeded"
    assert (body["limit"], body["value"], body["current"]) == ("max_concurrent_sandboxes", 50, 50)
    assert Sandbox.objects.filter(tenant=tenant, state__in=LIVE_STATES).count() == 50
    assert len(no_enqueue["provision"]) == 50  # a refused create enqueues nothing


def test_it_refuses_cpu_and_memory_totals_exactly_at_the_boundary(
    transactional_db, make_tenant, no_enqueue
):
    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        max_cpu_millis=3000, max_memory_mib=100_000
    )
    results = _burst(lambda: _create(tenant, cpu=1000), 12, workers=8)
    assert results.count(State.REQUESTED) == 3  # 3 × 1000m = 3000m: at, not over
    refused = [r for r in results if isinstance(r, ApiError)]
    assert {r.extra["limit"] for r in refused} == {"max_cpu_millis"}
    assert refused[0].extra["current"] == 3000

    other, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=other).pk).update(max_memory_mib=1024)
    results = _burst(lambda: _create(other, mem=256), 10, workers=8)
    assert results.count(State.REQUESTED) == 4
    assert {r.extra["limit"] for r in results if isinstance(r, ApiError)} == {"max_memory_mib"}


def test_it_refuses_a_sandbox_bigger_than_the_whole_quota_with_403(db, make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        max_cpu_millis=1000, max_lifetime_s=600
    )
    too_big = _create(tenant, cpu=2000, ttl_seconds=600, queue=True)
    assert isinstance(too_big, ApiError) and too_big.status_code == 403
    assert too_big.extra == {"limit": "max_cpu_millis", "value": 1000, "current": 2000}
    too_long = _create(tenant, ttl_seconds=601)
    assert isinstance(too_long, ApiError) and too_long.extra["limit"] == "max_lifetime_s"
    assert _create(tenant, ttl_seconds=600) == State.REQUESTED
    assert Sandbox.objects.filter(tenant=tenant).count() == 1


def test_it_holds_a_key_to_its_own_tighter_concurrency(transactional_db, make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    ApiKeyLimits.objects.create(api_key=key, max_concurrent_sandboxes=2)
    actor = f"key:{key.prefix}"
    results = _burst(lambda: _create(tenant, actor=actor), 8, workers=8)
    assert results.count(State.REQUESTED) == 2
    assert {r.extra["limit"] for r in results if isinstance(r, ApiError)} == {
        "key_max_concurrent_sandboxes"
    }
    assert _create(tenant, actor="key:otherkey") == State.REQUESTED  # the team is not full


@override_settings(HEDGEROW_MAX_LIVE_SANDBOXES=5)
def test_it_caps_live_sandboxes_cluster_wide_across_tenants(
    transactional_db, make_tenant, no_enqueue
):
    tenants = [make_tenant()[0] for _ in range(3)]
    results = _burst(lambda: [_create(t, queue=False) for t in tenants], 4, workers=4)
    flat = [r for batch in results for r in batch]
    assert flat.count(State.REQUESTED) == 5
    refused = [r for r in flat if isinstance(r, ApiError)]
    assert len(refused) == 7 and refused[0].extra["limit"] == "cluster_live_sandboxes"
    assert Sandbox.objects.filter(state__in=LIVE_STATES).count() == 5
    # Without queue=false the installation being full is no refusal: the create waits.
    assert _create(tenants[0]) == State.QUEUED


def test_it_counts_from_the_database_so_a_freed_slot_is_usable_at_once(db, make_tenant, no_enqueue):
    # "Counters survive restarts": there is no counter to lose; a fresh read of the
    # rows is the count. Simulate a restart by clearing every in-process cache.
    from apps.billing.limits import limits_cache_clear

    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=2)
    assert [_create(tenant), _create(tenant)] == [State.REQUESTED, State.REQUESTED]
    limits_cache_clear()
    assert isinstance(_create(tenant), ApiError)
    first = Sandbox.objects.filter(tenant=tenant).first()
    assert first is not None
    Sandbox.objects.filter(pk=first.pk).update(state=State.DELETED)
    assert _create(tenant) == State.REQUESTED


def test_it_stops_creates_once_the_monthly_budget_is_spent(db, make_tenant, no_enqueue):
    from apps.billing.tests.test_costs import ledger_sandbox

    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        monthly_budget=Decimal("1.00")
    )
    assert _create(tenant) == State.REQUESTED
    from django.utils import timezone

    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    # 8 vCPU for 4 h at the default $0.04/vCPU-h = $1.28 of this month: over budget.
    ledger_sandbox(
        tenant,
        start,
        [("provisioning", 0), ("ready", 10), ("deleted", 4 * 3600)],
        cpu_millis=8000,
        memory_mib=32,
    )
    refused = _create(tenant)
    assert isinstance(refused, ApiError)
    assert (refused.status_code, refused.code) == (403, "budget_exhausted")
    assert refused.extra["limit"] == "monthly_budget" and refused.extra["value"] == "1.00"
    assert Decimal(refused.extra["current"]) >= Decimal("1.28")
    queued = _create(tenant, queue=True)  # waiting would not help: still refused
    assert isinstance(queued, ApiError) and queued.code == "budget_exhausted"
    assert Sandbox.objects.filter(tenant=tenant).count() == 2  # the first + the ledger one
