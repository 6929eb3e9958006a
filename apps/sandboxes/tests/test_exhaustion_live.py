"""Exhaustion is named on every surface, and a dead agent is a lost sandbox (issue 14,
findings 7 and 8), through the real stack: REST, streamed exec, Orchard, the watcher."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from apps.billing.models import UsageRecord
from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Operation, OperationStatus, State
from apps.sandboxes.services.watching import watch_backend_once
from apps.sandboxes.tests.faults import api, create_ready, row, transitions, until, wait_state

pytestmark = pytest.mark.timeout(240)

# Touches every page of 4x the sandbox's 64Mi: the memory cgroup's OOM killer ends it.
OOM = ["python3", "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"]


def _assert_memory_error(error: dict[str, Any]) -> None:
    assert error["code"] == "resource_exhausted"
    assert error["kind"] == "memory"
    assert error["limit"] == 64 << 20
    assert error["signal"] == signal.SIGKILL


def _stream_frames(live: Any, path: str, secret: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    url = live.url.replace("http://", "ws://") + path
    with connect(url, additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
        try:
            while True:
                out.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed:
            pass
    return out


def test_an_oom_killed_command_is_a_typed_failure_on_rest_stream_and_orchard(
    live: Any, make_tenant: Any
) -> None:
    _, secret = make_tenant()
    http = api(live.url, secret)
    info = create_ready(http, memory="64Mi")
    url = f"/sandboxes/{info['id']}/exec"

    answer = http.post(url, json={"command": OOM, "operation_id": "oom-rest"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["status"], body["termination"]) == ("failed", "signaled")
    _assert_memory_error(body["error"])
    stored = http.get(f"/sandboxes/{info['id']}/operations/oom-rest").json()
    _assert_memory_error(stored["error"])
    # the agent survived its sandbox's OOM: the next command runs
    after = http.post(url, json={"command": "echo alive"}).json()
    assert (after["status"], after["stdout"]) == ("completed", "alive\n")

    started = http.post(url, json={"command": OOM, "stream": True, "operation_id": "oom-stream"})
    assert started.status_code == 202, started.text
    frames = _stream_frames(live, started.json()["stream_url"], secret)
    assert frames[-1]["type"] == "exec.exit"
    assert frames[-1]["result"]["status"] == "failed"
    _assert_memory_error(frames[-1]["result"]["error"])
    op = Operation.objects.get(operation_id="oom-stream")
    assert op.status == OperationStatus.FAILED
    _assert_memory_error(op.error or {})

    orchard = httpx.Client(
        base_url=live.url + "/orchard", headers={"X-API-Key": secret}, timeout=90, trust_env=False
    )
    job = orchard.post(f"/sandboxes/{info['id']}/exec", json={"wait": True, "command": OOM})
    assert job.status_code == 200, job.text
    assert job.json()["status"] == "failed"
    assert job.json()["exit_code"] == -signal.SIGKILL
    assert job.json()["resource_exhausted"] == {"kind": "memory", "limit": 64 << 20}
    assert job.json()["error"].startswith("resource_exhausted (memory)")
    ok = orchard.post(f"/sandboxes/{info['id']}/exec", json={"wait": True, "command": "true"})
    assert ok.json()["status"] == "succeeded" and ok.json()["resource_exhausted"] is None


def test_an_agent_killed_under_an_orphan_makes_the_sandbox_lost_and_ends_it(
    live: Any, make_tenant: Any
) -> None:
    _, secret = make_tenant()
    http = api(live.url, secret)
    info = create_ready(http)
    sandbox = row(info["id"])
    orphan = http.post(
        f"/sandboxes/{info['id']}/exec",
        json={"command": "setsid sleep 900 </dev/null >/dev/null 2>&1 &"},
    )
    assert orphan.json()["status"] == "completed", orphan.text
    meta = get_backend()._meta(sandbox.id.hex)  # type: ignore[attr-defined]
    assert meta is not None
    procs = [Path(p) for p in meta["cgroups"].values()]

    def sandbox_pids() -> set[int]:
        return {
            int(x)
            for path in procs
            for f in path.rglob("cgroup.procs")
            if f.exists()
            for x in f.read_text().split()
        }

    assert len(sandbox_pids()) >= 3
    os.kill(meta["agent_pid"], signal.SIGKILL)

    def lost() -> bool:
        watch_backend_once(timeout_s=0.5)
        sandbox.refresh_from_db()
        return sandbox.state == State.LOST

    until(lost, timeout=15, what="the watcher to mark the sandbox lost")
    assert transitions(sandbox)[-1] == ("lost", "backend_resource_gone")
    until(lambda: not sandbox_pids(), timeout=15, what="every process of the sandbox to end")
    # billing stopped at the loss: the usage record is closed
    usage = UsageRecord.objects.filter(sandbox=sandbox).first()
    assert usage is not None and usage.ended_at is not None and usage.end_state == "lost"
    refused = http.post(f"/sandboxes/{info['id']}/exec", json={"command": "true"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "sandbox_lost"
    assert http.delete(f"/sandboxes/{info['id']}").status_code == 202
    wait_state(sandbox, State.LOST)


# Many small processes, together over the 64Mi limit: each is smaller than the agent,
# so before the agent had its own cgroup the OOM killer chose the agent (502, and the
# policy's own failure was attributed to the environment: a reward-hacking route).
MANY_SMALL = (
    'for i in $(seq 12); do python3 -c "import time; b = bytearray(6 << 20); '
    "b[::4096] = b'x' * len(b[::4096]); time.sleep(3)\" & done; wait; exit 1"
)


def test_a_policy_that_exhausts_its_sandbox_is_classed_task_not_environment(
    live: Any, make_tenant: Any
) -> None:
    from hedgerow import Client

    from apps.trajectories.models import Episode

    _, secret = make_tenant()
    with Client(url=live.url, api_key=secret, max_retries=1, timeout=90) as hr:
        with hr.create_sandbox(memory="64Mi") as sandbox:
            with sandbox.episode(task_id="oom", harness="pytest", model="m-1") as episode:
                hog = sandbox.exec(MANY_SMALL, timeout=60)
                # (the raw body: the shared venv's SDK may predate ExecResult's property)
                assert hog.raw["error"]["code"] == "resource_exhausted", hog.raw
                assert hog.raw["error"]["kind"] == "memory"
                episode.verify("test -f /workspace/answer", timeout=10, name="answer")
    row = Episode.objects.get(episode_id=episode.id)
    assert row.failure_class == "task", row.failure_evidence
    op = Operation.objects.get(operation_id=hog.operation_id)
    assert (op.status, (op.error or {}).get("code")) == ("failed", "resource_exhausted")


def test_a_command_its_output_cap_ended_is_a_typed_failure_stored_with_its_kind(
    live: Any, make_tenant: Any
) -> None:
    _, secret = make_tenant()
    http = api(live.url, secret)
    info = create_ready(http)
    url = f"/sandboxes/{info['id']}/exec"

    answer = http.post(
        url, json={"command": "yes", "output_limit": 100_000, "operation_id": "cap-rest"}
    )

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["status"], body["termination"]) == ("failed", "output_limit")
    assert body["error"]["code"] == "resource_exhausted"
    assert (body["error"]["kind"], body["error"]["limit"]) == ("output", 100_000)
    stored = Operation.objects.get(operation_id="cap-rest")
    assert stored.status == OperationStatus.FAILED
    assert (stored.error or {}).get("kind") == "output"
    # the sandbox goes on: a command within the cap completes
    after = http.post(url, json={"command": "echo ok", "output_limit": 100_000}).json()
    assert (after["status"], after["stdout"]) == ("completed", "ok\n")


def test_a_policy_that_kills_everything_it_can_see_keeps_its_sandbox_and_is_classed_task(
    live: Any, make_tenant: Any
) -> None:
    """Issue 22 item 9: `kill -9 -1`, `pkill -9 -f .` and the agent's pid by number
    from a command reach no part of the sandbox that holds it (the agent runs as
    another real uid, pause is the pid namespace's init), and neither does a memory
    hog: the sandbox stays ready for the next exec, the watcher finds nothing gone,
    and the failing episode is the policy's (task), never environment."""
    from hedgerow import Client

    from apps.trajectories.models import Episode

    _, secret = make_tenant()
    with Client(url=live.url, api_key=secret, max_retries=1, timeout=90) as hr:
        with hr.create_sandbox(memory="64Mi") as sandbox:
            sandbox_row = row(sandbox.id)
            with sandbox.episode(task_id="kill", harness="pytest", model="m-1") as episode:
                for command in (
                    "kill -9 -1",
                    "pkill -9 -f . ; true",
                    "kill -9 $(pgrep -x hedgerow-agent); true",
                    "kill -9 1; true",
                ):
                    result = sandbox.exec(command, timeout=30)
                    assert result.raw["status"] == "completed", (command, result.raw)
                hog = sandbox.exec(OOM, timeout=60)
                _assert_memory_error(hog.raw["error"])
                after = sandbox.exec("echo alive", timeout=30)
                assert (after.exit_code, after.stdout) == (0, "alive\n")
                watch_backend_once(timeout_s=0.5)
                sandbox_row.refresh_from_db()
                assert sandbox_row.state == State.READY
                episode.verify("test -f /workspace/answer", timeout=10, name="answer")
    episode_row = Episode.objects.get(episode_id=episode.id)
    assert episode_row.failure_class == "task", episode_row.failure_evidence
    assert ("lost", "backend_resource_gone") not in transitions(sandbox_row)
