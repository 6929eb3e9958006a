"""Quotas, the admission queue and metering against the real stack (uvicorn, Celery,
Postgres, Redis, real sandboxes)."""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import httpx
import pytest

from apps.billing.models import TenantQuota, UsageRecord
from apps.billing.pricing import seconds_of
from apps.billing.quotas import quota_get
from apps.sandboxes.models import Sandbox, SandboxEvent, State

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("seeded_price_books")]


def _client(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )


def _limit(tenant, **fields):
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(**fields)


def _wait_state(external_id: str, state: str, timeout: float = 60) -> Sandbox:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = Sandbox.objects.get(external_id=external_id)
        if row.state == state:
            return row
        time.sleep(0.1)
    raise AssertionError(f"{external_id} stayed {row.state}, expected {state}")


def test_it_starts_a_queued_sandbox_when_another_ends(live, make_tenant):
    tenant, secret = make_tenant()
    _limit(tenant, max_concurrent_sandboxes=1)
    http = _client(live, secret)
    first = http.post("/sandboxes", json={"image": "host"}).json()
    queued = http.post("/sandboxes", json={"image": "host", "queue": True})
    assert queued.status_code == 201
    assert (queued.json()["state"], queued.json()["queue_position"]) == ("queued", 1)
    refused = http.post("/sandboxes", json={"image": "host"})
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert refused.json()["error"]["limit"] == "max_concurrent_sandboxes"
    import hedgerow

    sdk = hedgerow.Client(live.url, secret, cleanup=False, handle_signals=False, max_retries=0)
    with pytest.raises(hedgerow.QuotaExceeded):
        sdk.create_sandbox(wait=False)
    second = sdk.create_sandbox(wait=False, queue=True)
    assert (second.state, second.data["queue_position"]) == ("queued", 2)
    second.delete()  # a queued sandbox can be cancelled; the first in line keeps its place

    assert http.get(f"/sandboxes/{first['id']}/wait", params={"timeout": 60}).status_code == 200
    assert http.delete(f"/sandboxes/{first['id']}").status_code == 202
    # The first one's deletion enqueues a drain; the queued one is admitted and provisioned.
    ready = http.get(f"/sandboxes/{queued.json()['id']}/wait", params={"timeout": 90})
    assert ready.status_code == 200, ready.text
    assert ready.json()["state"] == "ready" and ready.json()["queue_position"] is None
    row = Sandbox.objects.get(external_id=queued.json()["id"])
    transitions = list(
        SandboxEvent.objects.filter(sandbox=row, event="transition").values_list(
            "from_state", "to_state", "reason"
        )
    )
    assert transitions[:2] == [
        ("queued", "requested", "admitted"),
        ("requested", "provisioning", "scheduled"),
    ]
    assert Sandbox.objects.get(external_id=first["id"]).state == State.DELETED


def test_it_refuses_concurrent_execs_over_http_exactly_at_the_limit(live, make_tenant):
    tenant, secret = make_tenant()
    _limit(tenant, max_concurrent_execs=2)
    http = _client(live, secret)
    sandbox = http.post("/sandboxes", json={"image": "host"}).json()
    assert http.get(f"/sandboxes/{sandbox['id']}/wait", params={"timeout": 60}).status_code == 200
    results: list[httpx.Response] = []
    barrier = threading.Barrier(5)

    def run() -> None:
        with _client(live, secret) as own:
            barrier.wait()
            results.append(
                own.post(f"/sandboxes/{sandbox['id']}/exec", json={"command": "sleep 4"})
            )

    threads = [threading.Thread(target=run) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 429, 429, 429]
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["limit"] == "max_concurrent_execs"
    # Slots come back when the execs end; refused execs left no operation behind.
    assert (
        http.post(f"/sandboxes/{sandbox['id']}/exec", json={"command": "true"}).status_code == 200
    )
    assert Sandbox.objects.get(external_id=sandbox["id"]).operations.count() == 3

    # Streamed execs take the same slots (held until the stream's command ends).
    url = f"/sandboxes/{sandbox['id']}/exec"
    streamed = [http.post(url, json={"command": "sleep 3", "stream": True}) for _ in range(3)]
    assert [r.status_code for r in streamed] == [202, 202, 429]
    assert streamed[2].json()["error"]["limit"] == "max_concurrent_execs"


def test_it_keeps_enforcing_after_the_web_process_restarts(live, make_tenant):
    tenant, secret = make_tenant()
    _limit(tenant, max_concurrent_sandboxes=2)
    http = _client(live, secret)
    made = [http.post("/sandboxes", json={"image": "host"}).json()["id"] for _ in range(2)]
    live.restart_web()
    http = _client(live, secret)
    refused = http.post("/sandboxes", json={"image": "host"})
    assert refused.status_code == 429
    assert refused.json()["error"]["current"] == 2
    http.delete(f"/sandboxes/{made[0]}")
    _wait_state(made[0], State.DELETED)
    assert http.post("/sandboxes", json={"image": "host"}).status_code == 201


def _ledger_cost(row: Sandbox, cpu: Decimal, gib: Decimal) -> Decimal:
    """The formula by hand from the lifecycle ledger, at the seeded default prices
    ($0.04/vCPU-h, $0.005/GiB-h, $0.0005 startup)."""
    events = SandboxEvent.objects.filter(sandbox=row, event="transition")
    start = events.get(to_state="provisioning").at
    end = events.get(to_state__in=["deleted", "failed"]).at
    hours = seconds_of(end - start) / 3600
    return hours * (cpu * Decimal("0.04") + gib * Decimal("0.005")) + Decimal("0.0005")


def test_it_bills_a_ttl_reaped_and_a_failed_sandbox_by_their_ledger(live, make_tenant):
    from apps.sandboxes.services.provisioning import sandbox_reap

    tenant, secret = make_tenant()
    http = _client(live, secret)
    body = {"image": "host", "cpu": 2, "memory": "512Mi", "ttl_seconds": 10}
    reaped = http.post("/sandboxes", json=body).json()
    assert http.get(f"/sandboxes/{reaped['id']}/wait", params={"timeout": 60}).status_code == 200
    row = Sandbox.objects.get(external_id=reaped["id"])
    while Sandbox.objects.get(pk=row.pk).expires_at.timestamp() > time.time():
        time.sleep(0.2)
    assert sandbox_reap()["ttl_expired"] >= 1
    row = _wait_state(reaped["id"], State.DELETED)
    assert row.events.filter(reason="ttl_expired").exists()
    expected = _ledger_cost(row, Decimal(2), Decimal("0.5"))
    shown = http.get(f"/sandboxes/{reaped['id']}").json()["cost"]
    assert Decimal(shown) == expected.quantize(Decimal("0.000001"))
    record = UsageRecord.objects.get(sandbox=row)
    assert record.end_state == "deleted" and record.ended_at is not None

    live.restart_worker({"HEDGEROW_READY_TIMEOUT_S": "0"})  # the agent is never "healthy"
    try:
        failed = http.post("/sandboxes", json={"image": "host", "cpu": "500m", "memory": 256})
        failed_row = _wait_state(failed.json()["id"], State.FAILED)
    finally:
        live.restart_worker()
    assert failed_row.events.filter(reason="provision_error").exists()
    expected = _ledger_cost(failed_row, Decimal("0.5"), Decimal("0.25"))
    shown = http.get(f"/sandboxes/{failed_row.external_id}").json()["cost"]
    assert Decimal(shown) == expected.quantize(Decimal("0.000001"))
    # It held resources, so it is billed for that time, not only the fee. (Compared on
    # the record, not on the six-decimal cost: a provision that fails in a few
    # milliseconds rounds to the fee alone.)
    failed_record = UsageRecord.objects.get(sandbox=failed_row)
    assert failed_record.end_state == "failed"
    assert failed_record.ended_at is not None and failed_record.ended_at > failed_record.started_at
    assert failed_record.hourly_rate > 0
