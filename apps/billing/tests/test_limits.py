"""Hot-path limits against the real Redis: concurrent execs, the token bucket, per-key
concurrency, upload bytes per day and PTY sessions — each exact at its boundary."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from apps.billing.limits import (
    exec_admit,
    exec_release,
    hot_limits,
    limits_cache_clear,
    limits_current,
    upload_admit,
    upload_record,
)
from apps.billing.models import ApiKeyLimits, TenantQuota
from apps.billing.quotas import quota_get
from apps.core.errors import ApiError
from apps.tenancy.models import ApiKey

pytestmark = pytest.mark.django_db


def _quota(tenant, **fields):
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(**fields)
    # Warm the in-process limits cache here: worker threads use their own connections
    # and cannot see this test's uncommitted rows.
    hot_limits(str(tenant.pk))
    return str(tenant.pk)


def _burst(fn, n):
    barrier = threading.Barrier(n)

    def run(_):
        barrier.wait()
        try:
            return fn()
        except ApiError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n)))


def test_it_admits_exactly_max_concurrent_execs_and_frees_slots_on_release(make_tenant):
    tenant, _ = make_tenant()
    tenant_id = _quota(tenant, max_concurrent_execs=5)
    results = _burst(lambda: exec_admit(tenant_id=tenant_id, api_key_id=None, timeout_s=30), 20)
    leases = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, ApiError)]
    assert len(leases) == 5
    assert len(refused) == 15
    body = refused[0].as_dict()["error"]
    assert refused[0].status_code == 429 and refused[0].headers["Retry-After"] == "1"
    assert (body["limit"], body["value"], body["current"]) == ("max_concurrent_execs", 5, 5)
    assert limits_current(tenant_id=tenant_id)["execs"] == 5
    exec_release(tenant_id=tenant_id, api_key_id=None, lease=leases[0])
    exec_admit(tenant_id=tenant_id, api_key_id=None, timeout_s=30)
    with pytest.raises(ApiError):
        exec_admit(tenant_id=tenant_id, api_key_id=None, timeout_s=30)


def test_it_refuses_the_exec_after_the_bucket_is_empty_with_retry_after(make_tenant):
    tenant, _ = make_tenant()
    # One token per 100 s: nothing refills during the test, so the boundary is exact.
    tenant_id = _quota(tenant, exec_rate_per_s=0.01, exec_burst=3)
    for _ in range(3):
        exec_release(
            tenant_id=tenant_id,
            api_key_id=None,
            lease=exec_admit(tenant_id=tenant_id, api_key_id=None, timeout_s=5),
        )
    with pytest.raises(ApiError) as refused:
        exec_admit(tenant_id=tenant_id, api_key_id=None, timeout_s=5)
    assert refused.value.status_code == 429
    assert refused.value.extra["limit"] == "exec_rate_per_s"
    assert 90 <= int(refused.value.headers["Retry-After"]) <= 100


def test_it_holds_one_key_to_its_tighter_exec_concurrency(make_tenant):
    tenant, _ = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    ApiKeyLimits.objects.create(api_key=key, max_concurrent_execs=2)
    tenant_id = _quota(tenant, max_concurrent_execs=10)
    results = _burst(
        lambda: exec_admit(tenant_id=tenant_id, api_key_id=str(key.pk), timeout_s=30), 8
    )
    refused = [r for r in results if isinstance(r, ApiError)]
    assert len(refused) == 6
    assert refused[0].extra["limit"] == "key_max_concurrent_execs"
    exec_admit(tenant_id=tenant_id, api_key_id=None, timeout_s=30)  # other callers still run


def test_it_counts_upload_bytes_per_day_exactly_under_concurrency(make_tenant):
    tenant, _ = make_tenant()
    tenant_id = _quota(tenant, upload_bytes_per_day=1000, max_upload_bytes=400)
    with pytest.raises(ApiError) as too_big:
        upload_admit(tenant_id=tenant_id, size=401, max_bytes=10_000)
    assert too_big.value.status_code == 413
    assert too_big.value.extra == {"limit": "max_upload_bytes", "value": 400, "current": 401}
    assert upload_admit(tenant_id=tenant_id, size=None, max_bytes=10_000) == 400
    results = _burst(lambda: upload_admit(tenant_id=tenant_id, size=150, max_bytes=10_000), 10)
    assert sum(1 for r in results if r == 400) == 6  # 6 × 150 = 900 ≤ 1000 < 7 × 150
    upload_record(tenant_id=tenant_id, nbytes=100)  # an unknown-length upload, counted after
    assert limits_current(tenant_id=tenant_id)["upload_bytes_today"] == 1000
    with pytest.raises(ApiError) as day:
        upload_admit(tenant_id=tenant_id, size=1, max_bytes=10_000)
    assert day.value.status_code == 429 and day.value.extra["limit"] == "upload_bytes_per_day"
    assert int(day.value.headers["Retry-After"]) > 0


def test_it_gives_the_terminal_consumer_the_teams_pty_limit(make_tenant, settings):
    from apps.sandboxes.services.pty import pty_tenant_limit

    settings.HEDGEROW_PTY_MAX_PER_TENANT = 16
    tenant, _ = make_tenant()
    assert pty_tenant_limit(tenant) == 16
    limits_cache_clear()
    _quota(tenant, max_pty_sessions=2)
    assert pty_tenant_limit(tenant) == 2
