"""The warm pool against the real stack: members are real sandboxes started by the real
worker, claimed through the real web process (restarted with a pool configured)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from apps.billing.models import UsageRecord
from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox, SandboxEvent, State, WarmMember, WarmMemberState
from apps.sandboxes.services import warm_pool
from apps.sandboxes.services.audit import audit_run
from apps.sandboxes.services.reconcile import sandbox_reconcile

pytestmark = pytest.mark.timeout(240)

# A shape no other test creates, so the pool configured in the shared web process
# changes nothing for them.
POOL = "host:250m:128Mi:none=2"
SHAPE = {"image": "host", "cpu": "250m", "memory": "128Mi"}


@pytest.fixture(scope="module")
def pool_web(stack: Any) -> Iterator[Any]:
    stack.web.env = {**stack.env, "HEDGEROW_WARM_POOL": POOL}
    stack.restart_web()
    try:
        yield stack
    finally:
        stack.web.env = stack.env
        stack.restart_web()


@pytest.fixture
def pool(pool_web: Any, live: Any, settings: Any) -> Iterator[Any]:
    settings.HEDGEROW_WARM_POOL = POOL
    settings.HEDGEROW_WARM_POOL_MAX_WARMING = 2
    yield live
    warm_pool.warm_pool_drain()


def _client(live: Any, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )


def _until(predicate: Any, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _warm_ids() -> list[Any]:
    return list(
        WarmMember.objects.filter(state=WarmMemberState.WARM)
        .order_by("warm_at")
        .values_list("id", flat=True)
    )


def _fill(n: int) -> list[Any]:
    """Refills (the worker starts the members) until ``n`` are warm, never starting a
    member beyond ``n``: the refill fills to the pool's target, so one called after a
    member turned warm but before this loop saw it would start an extra member, and
    a test that means "only these members" would race its coming up."""
    deadline = time.monotonic() + 90
    while len(_warm_ids()) < n:
        assert time.monotonic() < deadline, "pool did not fill"
        if WarmMember.objects.count() < n:
            warm_pool.warm_pool_refill()
        time.sleep(0.2)
    return _warm_ids()


def _resources(hex_id: str) -> set[str]:
    return {i.kind for i in get_backend().inventory() if i.sandbox_id == hex_id}


def _kill_member(member_id: Any) -> None:
    pids = [
        int(i.name)
        for i in get_backend().inventory()
        if i.sandbox_id == member_id.hex and i.kind == "process"
    ]
    assert pids, "member has no process"
    os.kill(pids[0], signal.SIGKILL)
    _until(lambda: get_backend().endpoint(member_id.hex) is None, 10, "member death")


def test_it_parses_the_pool_setting_and_refuses_bad_entries() -> None:
    targets = warm_pool.parse_targets("host:1000m:1Gi:none=3, img:0.5:512Mi:egress=1,x:1:64:none=0")
    assert targets == {
        warm_pool.Shape("host", 1000, 1024, False): 3,
        warm_pool.Shape("img", 500, 512, True): 1,
    }
    for bad in ("host:1000m:1Gi=3", "host:1000m:1Gi:open=3", "host:1000m:1Gi:none=x", "host=2"):
        with pytest.raises(ImproperlyConfigured, match="HEDGEROW_WARM_POOL"):
            warm_pool.parse_targets(bad)


def test_it_claims_a_warm_member_ready_at_once_and_deletes_it_normally(
    pool: Any, make_tenant: Any
) -> None:
    tenant, secret = make_tenant()
    oldest = _fill(2)[0]
    http = _client(pool, secret)
    created = http.post("/sandboxes", json=SHAPE)
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "ready"
    row = Sandbox.objects.get(tenant=tenant, external_id=created.json()["id"])
    assert row.id == oldest and row.generation == 1 and row.state == State.READY
    assert not WarmMember.objects.filter(pk=oldest).exists()
    waited = http.get(f"/sandboxes/{created.json()['id']}/wait", params={"timeout": 1})
    assert waited.status_code == 200 and waited.json()["state"] == "ready"
    ran = http.post(f"/sandboxes/{row.external_id}/exec", json={"command": "echo warm"})
    assert ran.status_code == 200, ran.text
    assert ran.json()["stdout"] == "warm\n"
    events = list(
        SandboxEvent.objects.filter(sandbox=row).values_list("event", "to_state", "reason")
    )
    assert events == [("created", "requested", "api"), ("transition", "ready", "warm_pool")]
    usage = UsageRecord.objects.get(sandbox=row)  # metering starts at the claim
    assert usage.started_at == SandboxEvent.objects.get(sandbox=row, reason="warm_pool").at

    assert http.delete(f"/sandboxes/{row.external_id}").status_code == 202
    _until(lambda: Sandbox.objects.get(pk=row.pk).state == State.DELETED, 30, "deleted")
    assert _resources(row.id.hex) == set()


def test_it_hides_a_claimed_sandbox_from_another_tenant(pool: Any, make_tenant: Any) -> None:
    _, owner = make_tenant()
    _, outsider = make_tenant()
    _fill(1)
    created = _client(pool, owner).post("/sandboxes", json=SHAPE)
    assert created.json()["state"] == "ready"
    sid = created.json()["id"]
    other = _client(pool, outsider)
    assert other.get(f"/sandboxes/{sid}").status_code == 404
    assert other.post(f"/sandboxes/{sid}/exec", json={"command": "id"}).status_code == 404
    assert other.delete(f"/sandboxes/{sid}").status_code == 404


def test_it_takes_the_cold_path_for_another_shape(pool: Any, make_tenant: Any) -> None:
    tenant, secret = make_tenant()
    members = _fill(1)
    created = _client(pool, secret).post("/sandboxes", json={**SHAPE, "cpu": "500m"})
    assert created.status_code == 201 and created.json()["state"] == "requested"
    row = Sandbox.objects.get(tenant=tenant)
    # No warm member was claimed: every one warm before is warm still (the refill
    # fills to the pool's target of 2, so a second may have turned warm meanwhile)
    assert row.id not in members and set(members) <= set(_warm_ids())
    _until(lambda: Sandbox.objects.get(pk=row.pk).state == State.READY, 60, "cold ready")
    reasons = list(
        SandboxEvent.objects.filter(sandbox=row, event="transition").values_list("reason")
    )
    assert ("warm_pool",) not in reasons


def test_it_never_hands_out_a_dead_member(pool: Any, make_tenant: Any, settings: Any) -> None:
    tenant, secret = make_tenant()
    dead, alive = _fill(2)[:2]
    _kill_member(dead)
    before = warm_pool.warm_pool_stats().get("discards", 0)
    http = _client(pool, secret)
    created = http.post("/sandboxes", json=SHAPE)
    assert created.json()["state"] == "ready", created.text
    row = Sandbox.objects.get(tenant=tenant)
    assert row.id == alive
    assert (
        http.post(f"/sandboxes/{row.external_id}/exec", json={"command": "true"}).json()[
            "exit_code"
        ]
        == 0
    )
    assert not WarmMember.objects.filter(pk=dead).exists()
    assert warm_pool.warm_pool_stats()["discards"] == before + 1
    _until(lambda: not _resources(dead.hex), 30, "dead member's resources destroyed")
    # Only dead members left: the cold path, never a dead one.
    settings.HEDGEROW_WARM_POOL_MAX_WARMING = 1
    assert not WarmMember.objects.exists()
    only = _fill(1)[0]
    assert list(WarmMember.objects.values_list("id", flat=True)) == [only]
    _kill_member(only)
    cold = http.post("/sandboxes", json=SHAPE)
    assert cold.json()["state"] == "requested"
    assert Sandbox.objects.get(external_id=cold.json()["id"], tenant=tenant).id != only


def test_it_never_gives_one_member_to_two_creates(pool: Any, make_tenant: Any) -> None:
    tenant, secret = make_tenant()
    members = set(_fill(2))
    answers: list[httpx.Response] = []

    def create() -> None:
        with _client(pool, secret) as http:
            answers.append(http.post("/sandboxes", json=SHAPE))

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [201] * 6
    rows = list(Sandbox.objects.filter(tenant=tenant))
    claimed = [r.id for r in rows if r.id in members]
    assert sorted(map(str, claimed)) == sorted(map(str, members))  # each exactly once
    assert len({r.id for r in rows}) == 6
    _until(
        lambda: Sandbox.objects.filter(tenant=tenant, state=State.READY).count() == 6, 90, "ready"
    )


def test_it_replays_an_idempotent_create_without_claiming_twice(
    pool: Any, make_tenant: Any
) -> None:
    tenant, secret = make_tenant()
    _fill(2)
    http = _client(pool, secret)
    first = http.post("/sandboxes", json=SHAPE, headers={"Idempotency-Key": "k-1"})
    again = http.post("/sandboxes", json=SHAPE, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert Sandbox.objects.filter(tenant=tenant).count() == 1
    assert len(_warm_ids()) == 1


def test_it_refills_to_the_target_with_bounded_concurrency(
    pool: Any, make_tenant: Any, settings: Any
) -> None:
    settings.HEDGEROW_WARM_POOL_MAX_WARMING = 1
    assert warm_pool.warm_pool_refill() == {"host:250m:128Mi:none": 1}
    assert WarmMember.objects.count() == 1  # one warming at a time
    _fill(2)
    assert warm_pool.warm_pool_refill() == {}  # at target
    _, secret = make_tenant()
    assert _client(pool, secret).post("/sandboxes", json=SHAPE).json()["state"] == "ready"
    assert len(_warm_ids()) == 1
    assert warm_pool.warm_pool_refill() == {"host:250m:128Mi:none": 1}
    _until(lambda: len(_warm_ids()) == 2, 60, "refilled")


def test_it_reconciles_members_and_reclaims_orphaned_member_resources(pool: Any) -> None:
    kept, orphan = _fill(2)[:2]
    run = sandbox_reconcile()
    assert not run.skipped and "leak_reclaimed" not in run.actions, run.actions
    assert _warm_ids() == [kept, orphan] and "process" in _resources(kept.hex)
    WarmMember.objects.filter(pk=orphan).delete()  # its row is gone: a leak now
    run = sandbox_reconcile()
    assert run.actions.get("leak_reclaimed") == 1, run.actions
    assert _resources(orphan.hex) == set() and "process" in _resources(kept.hex)
    _kill_member(kept)  # its resources vanished: dropped, not handed out later
    run = sandbox_reconcile()
    assert run.actions.get("pool_member_vanished") == 1, run.actions
    assert not WarmMember.objects.exists() and _resources(kept.hex) == set()


def test_it_balances_the_audit_with_members_alive(pool: Any, make_tenant: Any) -> None:
    since = timezone.now() - timedelta(seconds=1)
    _, secret = make_tenant()
    _fill(2)
    http = _client(pool, secret)
    sid = http.post("/sandboxes", json=SHAPE).json()["id"]
    http.delete(f"/sandboxes/{sid}")
    _until(lambda: not Sandbox.objects.exclude(state=State.DELETED).exists(), 30, "deleted")
    _until(lambda: len(_warm_ids()) >= 1, 30, "a member")
    run = audit_run(period_start=since, period_end=timezone.now())
    assert (run.created, run.deleted, run.live, run.leaked, run.orphaned) == (1, 1, 0, 0, 0)
    assert run.balanced, run.report
    assert run.report["pool_members"] == WarmMember.objects.count() >= 1
    assert "warm pool members" in run.report["equation"]


def test_it_drains_the_pool(pool: Any) -> None:
    members = _fill(2)
    assert warm_pool.warm_pool_drain() == 2
    assert not WarmMember.objects.exists()
    assert all(_resources(m.hex) == set() for m in members)


def test_it_reports_pool_gauges_in_metrics(pool: Any, make_tenant: Any) -> None:
    _fill(2)
    _, secret = make_tenant()
    assert _client(pool, secret).post("/sandboxes", json=SHAPE).json()["state"] == "ready"
    text = httpx.get(
        pool.url + "/metrics",
        headers={"Authorization": f"Bearer {pool.metrics_token}"},
        trust_env=False,
        timeout=30,
    ).text
    assert 'hedgerow_warm_pool_members{shape="host:250m:128Mi:none",state="warm"} 1.0' in text
    assert 'hedgerow_warm_pool_target{shape="host:250m:128Mi:none"} 2.0' in text
    assert "hedgerow_warm_pool_claims_total 1.0" in text


def _wait_requests(http: httpx.Client | httpx.AsyncClient) -> list[str]:
    """Records the path of every /wait request ``http`` sends (an httpx event hook)."""
    waits: list[str] = []

    def seen(request: httpx.Request) -> None:
        if request.url.path.endswith("/wait"):
            waits.append(request.url.path)

    async def seen_async(request: httpx.Request) -> None:
        seen(request)

    http.event_hooks["request"].append(seen_async if isinstance(http, httpx.AsyncClient) else seen)
    return waits


def test_it_lets_the_sdk_skip_the_wait_for_a_claimed_sandbox(pool: Any, make_tenant: Any) -> None:
    from hedgerow import Client

    tenant, secret = make_tenant()
    member = _fill(1)[0]
    with Client(pool.url, secret) as hr:
        waits = _wait_requests(hr._http)
        with hr.create_sandbox(image="host", cpu="250m", memory="128Mi") as sandbox:
            assert sandbox.state == "ready"
            assert Sandbox.objects.get(tenant=tenant, external_id=sandbox.id).id == member
            assert waits == []
            assert sandbox.exec("echo warm").stdout == "warm\n"
        # Not claimed (another shape): the create answers ``requested`` and the SDK waits.
        with hr.create_sandbox(image="host", cpu="500m", memory="128Mi") as cold:
            assert cold.state == "ready"
            assert waits == [f"/api/v1/sandboxes/{cold.id}/wait"]


def test_it_lets_the_async_sdk_skip_the_wait_for_a_claimed_sandbox(
    pool: Any, make_tenant: Any
) -> None:
    import asyncio

    from hedgerow import AsyncClient

    tenant, secret = make_tenant()
    member = _fill(1)[0]

    async def run() -> tuple[list[str], str, str]:
        async with AsyncClient(pool.url, secret) as hr:
            waits = _wait_requests(hr._http)
            warm = await hr.create_sandbox(image="host", cpu="250m", memory="128Mi")
            claimed = (warm.state, list(waits))
            await warm.delete()
            cold = await hr.create_sandbox(image="host", cpu="500m", memory="128Mi")
            await cold.delete()
            assert claimed == ("ready", [])
            return waits, warm.id, cold.id

    waits, warm_id, cold_id = asyncio.run(run())
    assert Sandbox.objects.get(tenant=tenant, external_id=warm_id).id == member
    assert waits == [f"/api/v1/sandboxes/{cold_id}/wait"]


def _forget_claims() -> None:
    from apps.core.redis_sync import redis_client

    redis_client().delete(warm_pool._last_claim_key(), warm_pool._deferred_key())


def test_it_refills_only_once_claims_are_quiet(pool: Any, make_tenant: Any, settings: Any) -> None:
    from apps.sandboxes import tasks

    _forget_claims()
    settings.HEDGEROW_WARM_POOL_REFILL_QUIET_S = 3600
    settings.HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S = 7200
    _fill(2)
    _, secret = make_tenant()
    # Claimed through the real web process: it records the claim for the refill.
    assert _client(pool, secret).post("/sandboxes", json=SHAPE).json()["state"] == "ready"
    assert warm_pool.warm_pool_refill_wait() > 3000
    # The debounced check and beat's tick (the same task) start nothing inside the
    # quiet period: the pool stays one short.
    assert tasks.warm_pool_refill() == {}
    assert WarmMember.objects.count() == 1
    # Quiet for long enough (the period is over): the same task refills to the target.
    settings.HEDGEROW_WARM_POOL_REFILL_QUIET_S = 0
    assert warm_pool.warm_pool_refill_wait() == 0
    assert tasks.warm_pool_refill() == {"host:250m:128Mi:none": 1}
    _until(lambda: len(_warm_ids()) == 2, 60, "refilled after the quiet period")
    assert tasks.warm_pool_refill() == {}


def test_it_refills_a_pool_held_back_too_long_despite_claims(
    pool: Any, make_tenant: Any, settings: Any
) -> None:
    from apps.sandboxes import tasks

    _forget_claims()
    settings.HEDGEROW_WARM_POOL_REFILL_QUIET_S = 3600
    settings.HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S = 7200
    _fill(2)
    _, secret = make_tenant()
    http = _client(pool, secret)
    assert http.post("/sandboxes", json=SHAPE).json()["state"] == "ready"
    assert tasks.warm_pool_refill() == {}
    # A steady stream is never quiet: once held back past the cap, it refills anyway.
    settings.HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S = 0
    assert tasks.warm_pool_refill() == {"host:250m:128Mi:none": 1}
    _until(lambda: len(_warm_ids()) == 2, 60, "refilled despite claims")
    # Back at target: the hold-back clock restarts with the next claim.
    assert tasks.warm_pool_refill() == {}
    settings.HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S = 7200
    assert http.post("/sandboxes", json=SHAPE).json()["state"] == "ready"
    assert tasks.warm_pool_refill() == {}
    assert len(_warm_ids()) == 1


def test_it_lets_beat_fill_an_empty_pool(pool: Any, settings: Any) -> None:
    from apps.sandboxes import tasks

    _forget_claims()
    entry = settings.CELERY_BEAT_SCHEDULE["warm-pool-refill"]
    assert entry["task"] == "apps.sandboxes.tasks.warm_pool_refill"
    assert not WarmMember.objects.exists()
    assert tasks.warm_pool_refill() == {"host:250m:128Mi:none": 2}
    _until(lambda: len(_warm_ids()) == 2, 60, "filled by beat's tick")


def test_it_claims_in_two_writes(pool: Any, make_tenant: Any) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create

    tenant, _ = make_tenant()
    first, member = _fill(2)[:2]
    request = SandboxRequest(image="host", cpu_millis=250, memory_mib=128)
    # The tenant's first create also writes its quota row: not the claim's cost.
    assert (
        sandbox_create(tenant=tenant, request=request, idempotency_key="k-0", actor="test")[0].id
        == first
    )
    with CaptureQueriesContext(connection) as captured:
        sandbox, created = sandbox_create(
            tenant=tenant, request=request, idempotency_key="k-stmt", actor="test"
        )
    assert created and sandbox.state == State.READY and sandbox.id == member
    heads = [q["sql"].split(None, 1)[0] for q in captured.captured_queries]
    print(f"statements in a claiming create: {len(heads)} {heads}")
    # The claim (DELETE … RETURNING) and the row + ledger + usage record (one WITH);
    # the rest are admission's reads and locks.
    assert [h for h in heads if h in ("INSERT", "UPDATE", "DELETE", "WITH")] == [
        "DELETE",
        "WITH",
    ], [q["sql"][:90] for q in captured.captured_queries]
    assert UsageRecord.objects.get(sandbox=sandbox).node == sandbox.node
