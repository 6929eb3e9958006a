"""The Orchard wire contract against the real stack: every endpoint the Orchard SDK
calls, with real sandboxes, in the order a rollout uses them."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from apps.orchard.tests.live import wait_all_deleted
from apps.sandboxes.models import Operation, Sandbox, State

pytestmark = pytest.mark.timeout(240)


def orchard(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/orchard", headers={"X-API-Key": secret}, timeout=90, trust_env=False
    )


def ready_sandbox(http: httpx.Client, **body) -> str:
    created = http.post("/sandboxes", json={"image": "host", **body})
    assert created.status_code == 200, created.text
    sandbox_id = created.json()["sandbox_id"]
    waited = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60})
    assert waited.status_code == 200, waited.text
    assert waited.json()["ready"] is True
    assert waited.json()["status"] == "ready"
    return str(sandbox_id)


def run(http: httpx.Client, sandbox_id: str, **body: Any) -> dict[str, Any]:
    response = http.post(f"/sandboxes/{sandbox_id}/exec", json={"wait": True, **body})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] in ("succeeded", "failed"), job
    return dict(job)


def test_it_serves_a_rollout_create_wait_exec_patch_files_heartbeat_delete(live, make_tenant):
    tenant, secret = make_tenant()
    http = orchard(live, secret)
    sandbox_id = ready_sandbox(http, sandbox_id="rollout-1")
    got = http.get(f"/sandboxes/{sandbox_id}").json()
    assert (got["sandbox_id"], got["ready"], got["status"]) == ("rollout-1", True, "ready")

    job = run(http, sandbox_id, command="echo hello; echo oops >&2")
    assert (job["status"], job["exit_code"], job["stdout"], job["stderr"]) == (
        "succeeded",
        0,
        "hello\n",
        "oops\n",
    )
    assert job["created_at"] <= job["started_at"] <= job["completed_at"]
    assert job["sandbox_id"] == sandbox_id and job["error"] is None

    # A list is quoted argument by argument, not joined with spaces.
    job = run(http, sandbox_id, command=["printf", "%s|", "a b", "$HOME", "c;d"])
    assert job["stdout"] == "a b|$HOME|c;d|"

    job = run(
        http,
        sandbox_id,
        command="pwd; echo $GREETING",
        cwd="/tmp",
        env={"GREETING": "hi there"},
        login_shell=True,
    )
    assert job["stdout"] == "/tmp\nhi there\n"

    # A real exit 124 is a failure, not a timeout; a timeout is typed as one.
    job = run(http, sandbox_id, command="exit 124")
    assert (job["status"], job["exit_code"], job["timed_out"], job["error"]) == (
        "failed",
        124,
        False,
        None,
    )
    job = run(http, sandbox_id, command="sleep 30", timeout_seconds=1)
    assert (job["status"], job["timed_out"], job["exit_code"]) == ("failed", True, 124)
    assert job["error"].startswith("timeout")
    # The timeout killed the command's session, not the sandbox.
    assert run(http, sandbox_id, command="echo alive")["stdout"] == "alive\n"

    # Without wait: the job is submitted, then waited for and read.
    submitted = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "sleep 1; echo late"})
    assert submitted.status_code == 200
    job_id = submitted.json()["job_id"]
    assert submitted.json()["status"] in ("queued", "running")
    waited = http.get(f"/jobs/{job_id}/wait", params={"timeout": 30}).json()
    assert (waited["status"], waited["stdout"]) == ("succeeded", "late\n")
    assert http.get(f"/jobs/{job_id}").json()["status"] == "succeeded"
    operation = Operation.objects.get(pk=job_id)
    assert (operation.status, operation.exit_code) == ("completed", 0)

    # apply_patch: a unified diff applies; one that does not is success false.
    put = http.post(
        f"/sandboxes/{sandbox_id}/files",
        json={"path": "/workspace/app.py", "content": base64.b64encode(b"x = 1\n").decode()},
    )
    assert put.json() == {"success": True, "path": "/workspace/app.py", "size": 6}
    diff = "--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    patched = http.post(f"/sandboxes/{sandbox_id}/apply_patch", json={"patch": diff}).json()
    assert patched["success"] is True, patched
    assert patched["exit_code"] == 0
    again = http.post(f"/sandboxes/{sandbox_id}/apply_patch", json={"patch": diff}).json()
    assert again["success"] is False and again["error"]

    got_file = http.get(f"/sandboxes/{sandbox_id}/files", params={"path": "/workspace/app.py"})
    assert got_file.status_code == 200
    assert base64.b64decode(got_file.json()["content"]) == b"x = 2\n"
    assert got_file.json()["size"] == 6

    payload = bytes(range(256)) * 64
    http.post(
        f"/sandboxes/{sandbox_id}/files",
        json={"path": "/workspace/sub/bin.dat", "content": base64.b64encode(payload).decode()},
    )
    listing = http.get(f"/sandboxes/{sandbox_id}/files/list", params={"path": "/workspace"})
    files = {f["name"]: f for f in listing.json()["files"]}
    assert files["sub"]["type"] == "directory"
    assert files["app.py"]["type"] == "file" and files["app.py"]["size"] == 6
    assert isinstance(files["app.py"]["modified"], float)
    missing = http.get(f"/sandboxes/{sandbox_id}/files", params={"path": "/workspace/none"})
    assert missing.status_code == 404 and "detail" in missing.json()

    beat = http.post(f"/sandboxes/{sandbox_id}/heartbeat")
    assert beat.status_code == 200 and beat.json()["status"] == "ok"

    deleted = http.delete(f"/sandboxes/{sandbox_id}")
    assert deleted.status_code == 200
    assert deleted.json()["status"] == "deleted" and deleted.json()["sandbox_id"] == sandbox_id
    sandbox = Sandbox.objects.get(tenant=tenant, external_id=sandbox_id)
    assert sandbox.state in (State.TERMINATING, State.DELETED)
    assert http.delete(f"/sandboxes/{sandbox_id}").status_code == 200
    refused = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "true"})
    assert refused.status_code in (404, 409) and "detail" in refused.json()
    wait_all_deleted(tenant)


def test_it_keeps_jobs_private_to_their_tenant(live, make_tenant):
    tenant, secret = make_tenant()
    _, other = make_tenant()
    http = orchard(live, secret)
    sandbox_id = ready_sandbox(http)
    job = run(http, sandbox_id, command="echo mine")
    outsider = orchard(live, other)
    assert outsider.get(f"/jobs/{job['job_id']}").status_code == 404
    assert outsider.get(f"/jobs/{job['job_id']}/wait").status_code == 404
    assert outsider.get(f"/sandboxes/{sandbox_id}").status_code == 404
    http.delete(f"/sandboxes/{sandbox_id}")
    wait_all_deleted(tenant)
