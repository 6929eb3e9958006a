"""A revoked key's open terminal (Hedgerow's and Orchard's) and exec stream close
within the documented delay (HEDGEROW_WS_REVALIDATE_S), through the real stack, and
the terminal's processes end with it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from apps.sandboxes.tests.live_api import api_client, ready_sandbox
from apps.sandboxes.tests.test_streaming_live import _ws
from apps.tenancy.models import ApiKey
from apps.tenancy.services import api_key_create, api_key_revoke

pytestmark = pytest.mark.timeout(180)

# the query and the close travel after the interval: a small allowance on top of it
SLACK_S = 2.0


def _two_keys(make_tenant: Any) -> tuple[str, str]:
    """(a key for the socket, which the test revokes; another key to drive the API)."""
    tenant, admin_secret = make_tenant()
    victim = api_key_create(tenant=tenant, name="victim", scopes=["read", "write"])
    return victim.secret, admin_secret


def _revoke(secret: str) -> float:
    from apps.tenancy.secrets import hash_secret

    api_key_revoke(key=ApiKey.objects.get(secret_hash=hash_secret(secret)))
    return time.monotonic()


def _close_after(ws: Any, revoked_at: float, limit: float) -> tuple[list[Any], int]:
    """Reads until the server closes (within ``limit`` of the revocation)."""
    seen: list[Any] = []
    try:
        while True:
            remaining = revoked_at + limit - time.monotonic()
            assert remaining > 0, f"still open {limit:.1f}s after the revocation"
            message = ws.recv(timeout=remaining)
            seen.append(json.loads(message) if isinstance(message, str) else message)
    except ConnectionClosed:
        pass
    assert ws.close_code is not None
    return seen, int(ws.close_code)


def _gone(http: Any, sandbox_id: str, pattern: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": ["pgrep", "-f", pattern]})
        if ran.json()["exit_code"] == 1:
            return
        assert time.monotonic() < deadline, f"{pattern!r} outlived its terminal"
        time.sleep(0.1)


def _running(http: Any, sandbox_id: str, pattern: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": ["pgrep", "-f", pattern]})
        if ran.json()["exit_code"] == 0:
            return
        assert time.monotonic() < deadline, f"{pattern!r} never started"
        time.sleep(0.1)


def test_a_revoked_keys_terminal_closes_with_4401_and_its_processes_end(
    live: Any, make_tenant: Any, settings: Any
) -> None:
    victim, admin = _two_keys(make_tenant)
    http = api_client(live, admin)
    sandbox_id = ready_sandbox(http)
    limit = settings.HEDGEROW_WS_REVALIDATE_S + SLACK_S
    with _ws(live, f"/ws/v1/sandboxes/{sandbox_id}/pty", victim) as ws:
        ws.send(json.dumps({"type": "pty.init", "cmd": ["sleep", "4242"]}))
        assert json.loads(ws.recv(timeout=20))["type"] == "pty.ready"
        _running(http, sandbox_id, "sleep 4242")
        seen, code = _close_after(ws, _revoke(victim), limit)
    assert code == 4401
    errors = [m for m in seen if isinstance(m, dict) and m.get("type") == "error"]
    assert errors and errors[-1]["code"] == "api_key_revoked"
    _gone(http, sandbox_id, "sleep 4242")


def test_a_revoked_keys_exec_stream_closes_with_4401(
    live: Any, make_tenant: Any, settings: Any
) -> None:
    victim, admin = _two_keys(make_tenant)
    http = api_client(live, admin)
    sandbox_id = ready_sandbox(http)
    started = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={
            "command": "for i in $(seq 600); do echo tick-$i; sleep 0.1; done",
            "stream": True,
            "operation_id": "op-long",
        },
    )
    assert started.status_code == 202, started.text
    path = f"/ws/v1/sandboxes/{sandbox_id}/operations/op-long/stream"
    with _ws(live, path, victim) as ws:
        assert json.loads(ws.recv(timeout=20))["type"].startswith("exec.")
        seen, code = _close_after(ws, _revoke(victim), settings.HEDGEROW_WS_REVALIDATE_S + SLACK_S)
    assert code == 4401
    assert seen[-1]["type"] == "error" and seen[-1]["code"] == "api_key_revoked"
    # the operation itself is the tenant's, not the key's: it keeps running
    assert http.get(f"/sandboxes/{sandbox_id}/operations/op-long").json()["status"] == "running"


def test_a_revoked_keys_orchard_terminal_closes_with_4401_and_its_processes_end(
    live: Any, make_tenant: Any, settings: Any
) -> None:
    victim, admin = _two_keys(make_tenant)
    http = api_client(live, admin)
    sandbox_id = ready_sandbox(http)
    url = live.url.replace("http://", "ws://")
    with connect(f"{url}/orchard/sandboxes/{sandbox_id}/exec/pty?api_key={victim}") as ws:
        ws.send(json.dumps({"type": "init", "cmd": ["sleep", "4343"], "rows": 24, "cols": 80}))
        assert json.loads(ws.recv(timeout=20))["type"] == "ready"
        _running(http, sandbox_id, "sleep 4343")
        seen, code = _close_after(ws, _revoke(victim), settings.HEDGEROW_WS_REVALIDATE_S + SLACK_S)
    assert code == 4401
    assert seen[-1]["type"] == "error" and seen[-1]["code"] == "api_key_revoked"
    _gone(http, sandbox_id, "sleep 4343")
