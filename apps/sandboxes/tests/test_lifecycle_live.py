"""Against the real stack: uvicorn, a Celery worker, Postgres, Redis, real sandboxes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Operation, Sandbox, SandboxEvent, State

pytestmark = pytest.mark.timeout(180)


def _client(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )


def _create_ready(http: httpx.Client, **body) -> dict[str, Any]:
    created = http.post("/sandboxes", json={"image": "host", **body})
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["id"]
    waited = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60})
    assert waited.status_code == 200, waited.text
    result: dict[str, Any] = waited.json()
    return result


def test_it_runs_the_readme_flow_create_exec_upload_download_delete(live, make_tenant):
    _, secret = make_tenant()
    http = _client(live, secret)
    sandbox = _create_ready(http)
    assert sandbox["state"] == "ready"
    assert sandbox["generation"] == 1

    ran = http.post(f"/sandboxes/{sandbox['id']}/exec", json={"command": "echo hello"})
    assert ran.status_code == 200, ran.text
    body = ran.json()
    assert (body["status"], body["termination"], body["exit_code"]) == ("completed", "exited", 0)
    assert body["stdout"] == "hello\n"

    payload = bytes(range(256)) * 1000
    up = http.put(
        f"/sandboxes/{sandbox['id']}/files",
        params={"path": "/workspace/dir/data.bin"},
        content=payload,
    )
    assert up.status_code == 200, up.text
    assert up.json()["size"] == len(payload)
    down = http.get(f"/sandboxes/{sandbox['id']}/files", params={"path": "/workspace/dir/data.bin"})
    assert down.status_code == 200
    assert down.content == payload
    listing = http.get(f"/sandboxes/{sandbox['id']}/files/list", params={"path": "/workspace/dir"})
    assert [e["name"] for e in listing.json()["entries"]] == ["data.bin"]

    deleted = http.delete(f"/sandboxes/{sandbox['id']}")
    assert deleted.status_code == 202
    final = http.get(f"/sandboxes/{sandbox['id']}/wait", params={"timeout": 30})
    assert final.json()["error"]["state"] in ("terminating", "deleted")
    row = Sandbox.objects.get(external_id=sandbox["id"])
    _wait_state(row, State.DELETED)
    transitions = list(
        SandboxEvent.objects.filter(sandbox=row, event="transition").values_list(
            "from_state", "to_state"
        )
    )
    assert transitions == [
        ("requested", "provisioning"),
        ("provisioning", "ready"),
        ("ready", "terminating"),
        ("terminating", "deleted"),
    ]
    assert not [i for i in get_backend().inventory() if i.sandbox_id == row.id.hex]
    assert http.delete(f"/sandboxes/{sandbox['id']}").status_code == 202  # idempotent


def _wait_state(row: Sandbox, state: str, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row.refresh_from_db()
        if row.state == state:
            return
        time.sleep(0.1)
    raise AssertionError(f"sandbox stayed {row.state}, expected {state}")


def test_it_kills_a_timed_out_command_with_its_children_and_keeps_the_sandbox(live, make_tenant):
    _, secret = make_tenant()
    http = _client(live, secret)
    sandbox = _create_ready(http)
    url = f"/sandboxes/{sandbox['id']}/exec"
    ran = http.post(
        url, json={"command": "sleep 100 & echo $! > /tmp/child; sleep 100", "timeout": 1}
    )
    body = ran.json()
    assert body["termination"] == "timeout" and body["timed_out"] is True
    assert body["exit_code"] is None
    child = http.post(url, json={"command": "cat /tmp/child"}).json()["stdout"].strip()
    alive = http.post(url, json={"command": f"kill -0 {child} && echo alive || echo gone"}).json()
    assert alive["stdout"].strip() == "gone"
    assert http.post(url, json={"command": "echo next"}).json()["stdout"] == "next\n"


def test_it_returns_the_stored_result_when_an_operation_id_is_replayed(live, make_tenant):
    _, secret = make_tenant()
    http = _client(live, secret)
    sandbox = _create_ready(http)
    url = f"/sandboxes/{sandbox['id']}/exec"
    body = {
        "command": "echo x >> /workspace/count; wc -l < /workspace/count",
        "operation_id": "op-1",
    }
    first = http.post(url, json=body).json()
    second = http.post(url, json=body).json()
    assert first["stdout"] == second["stdout"] == "1\n"
    assert Operation.objects.filter(operation_id="op-1").count() == 1
    conflict = http.post(url, json={**body, "command": "echo other"})
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "operation_conflict"


def test_it_refuses_a_stale_generation_and_a_missing_cwd(live, make_tenant):
    _, secret = make_tenant()
    http = _client(live, secret)
    sandbox = _create_ready(http)
    url = f"/sandboxes/{sandbox['id']}/exec"
    stale = http.post(url, json={"command": "true", "generation": sandbox["generation"] + 5})
    assert stale.status_code == 409
    assert stale.json()["error"]["code"] == "stale_generation"
    missing = http.post(url, json={"command": "pwd", "cwd": "/no/such/dir"})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "cwd_not_found"


def test_it_gives_one_sandbox_for_a_repeated_idempotency_key(live, make_tenant):
    _, secret = make_tenant()
    http = _client(live, secret)
    headers = {"Idempotency-Key": "create-once"}
    first = http.post("/sandboxes", json={"image": "host"}, headers=headers)
    second = http.post("/sandboxes", json={"image": "host"}, headers=headers)
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    different = http.post("/sandboxes", json={"image": "host", "cpu": 2}, headers=headers)
    assert different.status_code == 409
    assert different.json()["error"]["code"] == "idempotency_mismatch"
    assert Sandbox.objects.filter(idempotency_key="create-once").count() == 1
