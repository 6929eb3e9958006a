"""Limits per operation kind on the real stack (issue 17 goal 4, docs/billing.md
"Limits per operation kind"): a flood of one kind into a sandbox is refused with its
own typed 429 (naming the limit, with Retry-After) while another kind still gets
through, the sandbox stays ``ready`` to its health checks and a reconciler round
during the flood does not mark it lost. The stack runs with the installation's
defaults: 8 file transfers and 32 long execs per sandbox."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.conf import settings

from apps.billing.limits import in_flight
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.reconcile import sandbox_reconcile
from apps.sandboxes.tests.live_api import api_client, ready_sandbox, wait_all_deleted

pytestmark = pytest.mark.timeout(300)

BIG = 32 * 2**20  # far more than the loopback socket buffers: a download stays open


def _typed_429(response: httpx.Response, limit: str, value: int) -> None:
    assert response.status_code == 429, response.text[:300]
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert (error["code"], error["limit"], error["value"]) == ("quota_exceeded", limit, value)
    assert error["current"] == value, error


def _healthy(http: httpx.Client, live, sandbox_id: str) -> None:
    """What a health check sees: the control plane answers, the sandbox is ready, the
    reconciler does not judge it lost."""
    assert httpx.get(live.url + "/healthz", timeout=10, trust_env=False).status_code == 200
    assert http.get(f"/sandboxes/{sandbox_id}").json()["state"] == "ready"
    sandbox_reconcile()
    assert Sandbox.objects.get(external_id=sandbox_id).state == State.READY


def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_flood_of_downloads_is_refused_by_kind_while_execs_and_health_get_through(
    live, make_tenant
):
    limit = settings.HEDGEROW_FILE_TRANSFERS_PER_SANDBOX
    assert limit == 8  # the default the stack runs with
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    http.timeout = httpx.Timeout(120)
    sandbox_id = ready_sandbox(http)
    other_id = ready_sandbox(http)
    made = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": f"head -c {BIG} /dev/zero > /workspace/big.bin"},
    )
    assert made.json()["exit_code"] == 0, made.text
    files = f"/sandboxes/{sandbox_id}/files"
    path = {"path": "/workspace/big.bin"}

    opened = [
        http.send(http.build_request("GET", files, params=path), stream=True) for _ in range(limit)
    ]
    try:
        assert [r.status_code for r in opened] == [200] * limit
        # The next transfer of this sandbox, a download or an upload, is refused by name.
        refused = http.get(files, params=path)
        _typed_429(refused, "file_transfers_per_sandbox", limit)
        upload = http.put(files, params={"path": "/workspace/x"}, content=b"x")
        _typed_429(upload, "file_transfers_per_sandbox", limit)
        # Another kind in the same sandbox runs, and so does a transfer elsewhere.
        ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "echo through"})
        assert ran.status_code == 200 and ran.json()["stdout"] == "through\n", ran.text
        put = http.put(
            f"/sandboxes/{other_id}/files", params={"path": "/workspace/y"}, content=b"y" * 10
        )
        assert put.status_code == 200, put.text
        _healthy(http, live, sandbox_id)
        # Every open download is whole, byte for byte in length.
        for response in opened:
            assert sum(len(chunk) for chunk in response.iter_bytes()) == BIG
    finally:
        for response in opened:
            response.close()
    # Each finished download gave its slot back.
    _until(lambda: in_flight("file", str(tenant.pk), sandbox_id) == 0, "slots not released")
    again = http.get(files, params={"path": "/workspace/big.bin"})
    assert again.status_code == 200 and len(again.content) == BIG
    http.delete(f"/sandboxes/{sandbox_id}")
    http.delete(f"/sandboxes/{other_id}")
    wait_all_deleted(tenant)


def test_a_flood_of_long_execs_leaves_short_execs_running(live, make_tenant):
    limit = settings.HEDGEROW_LONG_EXEC_MAX_PER_SANDBOX
    assert limit == 32 and settings.HEDGEROW_EXEC_LONG_AFTER_S == 60
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    http.timeout = httpx.Timeout(180)
    sandbox_id = ready_sandbox(http)
    exec_url = f"/sandboxes/{sandbox_id}/exec"
    # Long by their timeout; they run until the sandbox is deleted below.
    long_cmd = {"command": "sleep 600", "timeout": 120}
    pool = ThreadPoolExecutor(max_workers=limit)
    with httpx.Client(
        base_url=str(http.base_url),
        headers=dict(http.headers),
        timeout=180,
        trust_env=False,
        limits=httpx.Limits(max_connections=limit + 4),
    ) as flood:
        futures = [pool.submit(flood.post, exec_url, json=long_cmd) for _ in range(limit)]
        tid = str(tenant.pk)
        _until(lambda: in_flight("long_exec", tid, sandbox_id) == limit, "long execs not admitted")
        _typed_429(http.post(exec_url, json=long_cmd), "long_execs_per_sandbox", limit)
        # A short exec in the same sandbox is another kind: it runs at once.
        ran = http.post(exec_url, json={"command": "echo short", "timeout": 30})
        assert ran.status_code == 200 and ran.json()["stdout"] == "short\n", ran.text
        _healthy(http, live, sandbox_id)
        # Deleting the sandbox ends the long commands; each request answers and
        # gives its slot back.
        assert http.delete(f"/sandboxes/{sandbox_id}").status_code == 202
        answers = [f.result(timeout=120) for f in futures]
    pool.shutdown()
    assert all(a.status_code != 200 or a.json()["termination"] != "exited" for a in answers)
    _until(lambda: in_flight("long_exec", tid, sandbox_id) == 0, "long exec slots kept")
    wait_all_deleted(tenant)
