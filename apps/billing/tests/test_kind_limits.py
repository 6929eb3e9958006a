"""Limits per operation kind against the real Redis (docs/billing.md "Limits per
operation kind"): short execs, long execs and file transfers each have their own pools
per sandbox, tenant and installation, in requests and in execution seconds or bytes;
a full pool refuses only its own kind, with a typed 429 that names the limit."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from apps.billing.limits import (
    _key,
    exec_admit,
    exec_admit_plan,
    exec_kind,
    exec_release,
    hot_limits,
    in_flight,
    transfer_admit,
    transfer_release,
)
from apps.core.errors import ApiError
from apps.core.redis_sync import redis_client

pytestmark = pytest.mark.django_db


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


def _refusal(exc: ApiError, limit: str) -> dict[str, Any]:
    assert exc.status_code == 429, exc
    assert exc.headers["Retry-After"] == "1"
    body: dict[str, Any] = exc.as_dict()["error"]
    assert body["code"] == "quota_exceeded" and body["limit"] == limit, body
    return body


def test_an_exec_is_long_past_the_threshold(settings):
    settings.HEDGEROW_EXEC_LONG_AFTER_S = 60
    assert exec_kind(60) == "exec"
    assert exec_kind(60.5) == "long_exec"


def test_a_full_sandbox_pool_of_long_execs_leaves_short_execs_and_other_sandboxes_alone(
    make_tenant, settings
):
    settings.HEDGEROW_LONG_EXEC_MAX_PER_SANDBOX = 3
    settings.HEDGEROW_EXEC_MAX_PER_SANDBOX = 5
    tenant, _ = make_tenant()
    tid = str(tenant.pk)
    hot_limits(tid)  # cached here: the burst's threads have their own connections

    results = _burst(
        lambda: exec_admit(tenant_id=tid, api_key_id=None, timeout_s=600, sandbox_key="sb-a"), 10
    )
    leases = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, ApiError)]
    assert len(leases) == 3 and len(refused) == 7
    body = _refusal(refused[0], "long_execs_per_sandbox")
    assert (body["value"], body["current"]) == (3, 3)
    assert "sandbox" in body["message"] and "long execs" in body["message"]
    assert in_flight("long_exec", tid, "sb-a") == 3

    # Short execs in the same sandbox have their own pool, exact at its boundary.
    short = [
        exec_admit(tenant_id=tid, api_key_id=None, timeout_s=10, sandbox_key="sb-a")
        for _ in range(5)
    ]
    with pytest.raises(ApiError) as full:
        exec_admit(tenant_id=tid, api_key_id=None, timeout_s=10, sandbox_key="sb-a")
    _refusal(full.value, "execs_per_sandbox")
    # Another sandbox of the same team is not touched by either.
    other = exec_admit(tenant_id=tid, api_key_id=None, timeout_s=600, sandbox_key="sb-b")

    # A release frees exactly one slot of its own pool.
    exec_release(tenant_id=tid, api_key_id=None, lease=leases[0], sandbox_key="sb-a")
    assert in_flight("long_exec", tid, "sb-a") == 2
    leases[0] = exec_admit(tenant_id=tid, api_key_id=None, timeout_s=600, sandbox_key="sb-a")
    for lease in [*leases, *short, other]:
        for key in ("sb-a", "sb-b"):
            exec_release(tenant_id=tid, api_key_id=None, lease=lease, sandbox_key=key)
    assert in_flight("long_exec", tid, "sb-a") == 0 and in_flight("exec", tid, "sb-a") == 0


def test_long_execs_are_held_to_execution_seconds_per_tenant(make_tenant, settings):
    settings.HEDGEROW_LONG_EXEC_SECONDS_PER_TENANT = 1000
    tenant, _ = make_tenant()
    tid = str(tenant.pk)
    first = exec_admit(tenant_id=tid, api_key_id=None, timeout_s=600, sandbox_key="a")
    with pytest.raises(ApiError) as refused:  # 600 + 600 > 1000
        exec_admit(tenant_id=tid, api_key_id=None, timeout_s=600, sandbox_key="b")
    body = _refusal(refused.value, "long_exec_seconds_per_tenant")
    assert (body["value"], body["current"]) == (1000, 600)
    second = exec_admit(tenant_id=tid, api_key_id=None, timeout_s=400, sandbox_key="b")  # = 1000
    # Short execs weigh nothing against it.
    exec_release(
        tenant_id=tid,
        api_key_id=None,
        lease=exec_admit(tenant_id=tid, api_key_id=None, timeout_s=30, sandbox_key="c"),
        sandbox_key="c",
    )
    exec_release(tenant_id=tid, api_key_id=None, lease=first, sandbox_key="a")
    exec_release(tenant_id=tid, api_key_id=None, lease=second, sandbox_key="b")
    assert in_flight("long_exec", tid) == 0


def test_the_installation_pool_is_shared_by_every_team(make_tenant, settings):
    first, _ = make_tenant()
    second, _ = make_tenant()
    already = in_flight("long_exec", None)  # what other runs left in this instance's pool
    settings.HEDGEROW_LONG_EXEC_MAX_PER_INSTALLATION = already + 2
    a = exec_admit(tenant_id=str(first.pk), api_key_id=None, timeout_s=120, sandbox_key="x")
    b = exec_admit(tenant_id=str(second.pk), api_key_id=None, timeout_s=120, sandbox_key="y")
    with pytest.raises(ApiError) as refused:
        exec_admit(tenant_id=str(second.pk), api_key_id=None, timeout_s=120, sandbox_key="z")
    _refusal(refused.value, "long_execs_per_installation")
    # A short exec still runs: the long pool is not its pool.
    exec_release(
        tenant_id=str(second.pk),
        api_key_id=None,
        lease=exec_admit(tenant_id=str(second.pk), api_key_id=None, timeout_s=5, sandbox_key="z"),
        sandbox_key="z",
    )
    exec_release(tenant_id=str(first.pk), api_key_id=None, lease=a, sandbox_key="x")
    exec_release(tenant_id=str(second.pk), api_key_id=None, lease=b, sandbox_key="y")


def test_the_fast_paths_plan_counts_the_same_pools(make_tenant, settings):
    settings.HEDGEROW_LONG_EXEC_MAX_PER_SANDBOX = 2
    tenant, _ = make_tenant()
    tid = str(tenant.pk)
    plan = exec_admit_plan(
        limits=hot_limits(tid), tenant_id=tid, api_key_id=None, timeout_s=600, sandbox_key="s"
    )
    key = plan.keys[3]
    assert key.endswith(f"long_exec:sbx:{tid}:s") and plan.args[7:9] == [2, 0]
    assert key in plan.release_keys
    short = exec_admit_plan(
        limits=hot_limits(tid), tenant_id=tid, api_key_id=None, timeout_s=5, sandbox_key="s"
    )
    assert all("long_exec" not in k for k in short.keys)


def test_file_transfers_per_sandbox_and_bytes_per_tenant(make_tenant, settings):
    settings.HEDGEROW_FILE_TRANSFERS_PER_SANDBOX = 2
    settings.HEDGEROW_FILE_BYTES_PER_TENANT = 300 * 2**20
    tenant, _ = make_tenant()
    tid = str(tenant.pk)
    one = transfer_admit(tenant_id=tid, sandbox_key="s1", nbytes=200 * 2**20)
    two = transfer_admit(tenant_id=tid, sandbox_key="s1", nbytes=0)
    with pytest.raises(ApiError) as busy:
        transfer_admit(tenant_id=tid, sandbox_key="s1", nbytes=1)
    body = _refusal(busy.value, "file_transfers_per_sandbox")
    assert (body["value"], body["current"]) == (2, 2)
    with pytest.raises(ApiError) as heavy:  # another sandbox: 200 + 101 MiB > 300 MiB
        transfer_admit(tenant_id=tid, sandbox_key="s2", nbytes=101 * 2**20)
    body = _refusal(heavy.value, "file_bytes_per_tenant")
    assert body["current"] == 200 * 2**20
    # Execs are another kind: a full transfer pool does not touch them.
    exec_release(
        tenant_id=tid,
        api_key_id=None,
        lease=exec_admit(tenant_id=tid, api_key_id=None, timeout_s=5, sandbox_key="s1"),
        sandbox_key="s1",
    )
    transfer_release(tenant_id=tid, sandbox_key="s1", lease=one)
    three = transfer_admit(tenant_id=tid, sandbox_key="s2", nbytes=100 * 2**20)
    for lease in (two, three):
        for key in ("s1", "s2"):
            transfer_release(tenant_id=tid, sandbox_key=key, lease=lease)
    assert in_flight("file", tid, "s1") == 0 and in_flight("file", tid) == 0


def test_a_single_transfer_larger_than_the_bytes_limit_is_admitted_alone(make_tenant, settings):
    """The bytes limit bounds what is in flight together: one transfer bigger than it
    still runs when nothing else is (the size limits are max_upload_bytes' job)."""
    settings.HEDGEROW_FILE_BYTES_PER_TENANT = 10
    tenant, _ = make_tenant()
    tid = str(tenant.pk)
    lease = transfer_admit(tenant_id=tid, sandbox_key="s", nbytes=1000)
    with pytest.raises(ApiError):
        transfer_admit(tenant_id=tid, sandbox_key="s", nbytes=1)
    transfer_release(tenant_id=tid, sandbox_key="s", lease=lease)


def test_in_flight_says_a_redis_error_instead_of_reading_an_empty_pool(make_tenant):
    """A pool Redis cannot count (here: its key holds a string, a real WRONGTYPE error)
    is an error, never 0 leases: "the slot was given back" must not pass on an error."""
    tid = str(make_tenant()[0].pk)
    key = _key("file", "sbx", tid, "broken")
    redis_client().set(key, "not a sorted set", ex=60)
    try:
        with pytest.raises(redis.ResponseError):
            in_flight("file", tid, "broken")
    finally:
        redis_client().delete(key)
    assert in_flight("file", tid, "broken") == 0
