"""Snapshots against the real stack, part two (issue 16): the runtime fingerprint
(listening ports, processes, environment) in restored children, and what pauses and
snapshots cost and count against quotas."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from apps.billing.models import StorageRecord, TenantQuota, UsageRecord
from apps.billing.quotas import quota_get
from apps.sandboxes.backends import get_backend
from apps.sandboxes.metering.usage import sandbox_cost
from apps.sandboxes.models import Sandbox, Snapshot
from apps.sandboxes.tests.live_api import api_client, ready_sandbox
from apps.sandboxes.tests.test_snapshots_live import _children_settled, _exec, _settled, _snapshot

pytestmark = pytest.mark.timeout(300)

SERVER = "python3 -m http.server 8765 --bind 127.0.0.1"
# starts the server detached and returns once it listens (a service must leave it up)
START = (
    f"setsid {SERVER} >/dev/null 2>&1 < /dev/null & "
    "for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/8765) 2>/dev/null && exit 0; "
    "sleep 0.1; done; exit 1"
)


def test_children_match_the_captured_ports_processes_and_environment(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    assert _exec(http, parent, f"bash -c '{START}'")["exit_code"] == 0
    restarting = _snapshot(http, parent, manifest={"services": [["bash", "-c", START]]})
    assert restarting["state"] == "ready", restarting
    fingerprint = restarting["fingerprint"]
    assert {"proto": "tcp", "address": "loopback", "port": 8765} in fingerprint["ports"]
    assert SERVER.split() in fingerprint["processes"]
    assert fingerprint["env"]["PATH"] and fingerprint["volatile"] == []

    # the manifest's service brings the server back: same ports, same processes
    made = http.post("/sandboxes", json={"from_snapshot": restarting["id"]})
    (child,) = _children_settled(http, [made.json()["id"]])
    assert child["state"] == "ready" and child["divergence"] is None, child

    # without the service the server is gone in the child: not the same state
    bare = _snapshot(http, parent)
    made = http.post("/sandboxes", json={"from_snapshot": bare["id"]})
    (diverged,) = _children_settled(http, [made.json()["id"]])
    assert diverged["state"] == "failed", diverged
    assert diverged["divergence"] == [
        {
            "fingerprint": "ports",
            "missing": [{"proto": "tcp", "address": "loopback", "port": 8765}],
            "unexpected": [],
        },
        {"fingerprint": "processes", "missing": [SERVER.split()], "unexpected": []},
    ]
    failed_row = Sandbox.objects.get(external_id=diverged["id"])
    assert failed_row.events.filter(to_state="failed", reason="state_divergence").exists()

    # declared volatile: recorded, shown, not compared
    loose = _snapshot(http, parent, volatile=["ports", "process:python3"])
    assert loose["fingerprint"]["volatile"] == ["ports", "process:python3"]
    assert SERVER.split() in loose["fingerprint"]["processes"]
    made = http.post("/sandboxes", json={"from_snapshot": loose["id"]})
    (allowed,) = _children_settled(http, [made.json()["id"]])
    assert allowed["state"] == "ready", allowed

    bad = http.post(f"/sandboxes/{parent}/snapshots", json={"volatile": ["everything"]})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "volatile"


def _wait(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_paused_sandbox_bills_its_state_not_compute_and_resume_is_admitted(live, make_tenant):
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox = ready_sandbox(http, cpu="500m", memory="256Mi")
    row = Sandbox.objects.get(external_id=sandbox)
    assert _exec(http, sandbox, "head -c 2097152 /dev/urandom > /workspace/d")["exit_code"] == 0
    assert http.post(f"/sandboxes/{sandbox}/pause").status_code == 202
    released = row.events.filter(event="compute_released")
    _wait(released.exists, "the pause did not release compute")
    pause = Snapshot.objects.get(sandbox=row, kind="pause")
    kept = StorageRecord.objects.get(snapshot=pause)
    assert kept.kind == "pause" and kept.size_bytes == pause.size_bytes >= 2 << 20
    assert kept.ended_at is None and kept.gib_hour > 0
    record = UsageRecord.objects.get(sandbox=row)
    assert record.pauses == [[released.get().at.isoformat(), None]]
    # while paused an hour costs the kept bytes' storage, and no CPU or memory
    row.refresh_from_db()
    now = timezone.now()
    an_hour = sandbox_cost(sandbox=row, now=now + timedelta(hours=1))
    assert an_hour is not None
    assert an_hour - sandbox_cost(sandbox=row, now=now) == (  # type: ignore[operator]
        kept.gib_hour * Decimal(kept.size_bytes) / (1 << 30)
    )
    assert Decimal(http.get(f"/sandboxes/{sandbox}").json()["cost"]) > 0
    assert http.get("/quota").json()["snapshot_bytes"]["current"] == pause.size_bytes

    # a paused sandbox holds no compute: another one starts in its place under a limit
    # of one; resuming takes compute again, so it is admitted like a create: refused
    # while the other runs (and it stays paused), accepted once that one is gone
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=1)
    other = ready_sandbox(http)
    refused = http.post(f"/sandboxes/{sandbox}/resume")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["limit"] == "max_concurrent_sandboxes"
    assert http.get(f"/sandboxes/{sandbox}").json()["state"] == "paused"
    assert http.delete(f"/sandboxes/{other}").status_code == 202
    _settled(http, f"/sandboxes/{other}", ("deleted",))
    assert http.post(f"/sandboxes/{sandbox}/resume").status_code == 202
    assert _settled(http, f"/sandboxes/{sandbox}", ("ready", "failed"), 120)["state"] == "ready"
    record.refresh_from_db()
    assert record.pauses[0][1] is not None  # compute is billed again from the resume
    kept.refresh_from_db()
    assert kept.ended_at is not None  # the spent pause is no longer kept, nor billed


def test_the_storage_quota_refuses_captures_and_pauses_and_a_capture_over_it_fails_clean(
    live, make_tenant
):
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox = ready_sandbox(http)
    assert _exec(http, sandbox, "head -c 1048576 /dev/urandom > /workspace/d")["exit_code"] == 0
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_snapshot_bytes=4096)
    # the size is known only after the capture: over the limit it fails, keeping nothing
    over = _snapshot(http, sandbox)
    assert over["state"] == "failed" and over["error"]["code"] == "quota_exceeded", over
    assert "4096" in over["error"]["message"]
    assert over["id"].replace("-", "") not in get_backend().snapshots()  # type: ignore[attr-defined]
    assert not StorageRecord.objects.filter(snapshot_id=over["id"]).exists()
    # a pause over it fails the same way and the sandbox runs on
    assert http.post(f"/sandboxes/{sandbox}/pause").status_code == 202
    back = _settled(http, f"/sandboxes/{sandbox}", ("ready",), 60)
    assert back["state"] == "ready"
    assert _exec(http, sandbox, "cat /workspace/d | wc -c")["stdout"].strip() == "1048576"
    # at the limit, new captures and pauses are refused up front, nothing recorded
    TenantQuota.objects.filter(tenant=tenant).update(max_snapshot_bytes=0)
    before = Snapshot.objects.filter(sandbox__external_id=sandbox).count()
    refused = http.post(f"/sandboxes/{sandbox}/snapshots", json={})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["limit"] == "max_snapshot_bytes"
    paused = http.post(f"/sandboxes/{sandbox}/pause")
    assert paused.status_code == 429 and paused.json()["error"]["limit"] == "max_snapshot_bytes"
    assert http.get(f"/sandboxes/{sandbox}").json()["state"] == "ready"
    assert Snapshot.objects.filter(sandbox__external_id=sandbox).count() == before
