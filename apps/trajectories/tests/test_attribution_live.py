"""Each class of the decision procedure against the real stack and real sandboxes.

Infra classes must come from the control plane's own ledger and operation records,
so these tests cause the faults for real: an agent killed behind the control plane's
back (the watcher marks the sandbox lost), output cut by the exec window, a verifier
command that times out, an image the agent cannot start in.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from hedgerow import Client, SandboxLost, SandboxNotReady

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.watching import watch_backend_once
from apps.trajectories.models import Episode

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _settled(live):
    """Waits for the worker to finish destroying this test's sandboxes: flushing the
    database under a running destroy task deadlocks."""
    yield
    deadline = time.monotonic() + 60
    busy = (State.REQUESTED, State.PROVISIONING, State.TERMINATING)
    while Sandbox.objects.filter(state__in=busy).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _sdk(live, secret: str) -> Client:
    return Client(url=live.url, api_key=secret, max_retries=1, timeout=90)


def _http(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )


def test_it_records_execs_as_steps_and_classes_success_and_task(live, make_tenant):
    _, secret = make_tenant()
    with _sdk(live, secret) as hr, hr.create_sandbox() as sandbox:
        with sandbox.episode(task_id="make-file", harness="pytest", model="m-1") as solved:
            sandbox.exec("echo hi > /workspace/answer")
            solved.step(action="done", kind="model", model_call={"tokens_in": 5, "tokens_out": 1})
            solved.verify("test -f /workspace/answer", timeout=10, name="exists")
        with sandbox.episode(task_id="make-file", harness="pytest", model="m-1") as failed:
            sandbox.exec("rm -f /workspace/answer")
            failed.verify("test -f /workspace/answer", timeout=10, name="exists")
    assert solved.failure_class == "success"
    assert failed.failure_class == "task"
    row = Episode.objects.get(episode_id=solved.id)
    steps = list(row.steps.all())
    assert [s.kind for s in steps] == ["exec", "model", "verifier"]
    assert steps[0].operation_record is not None  # linked to the control plane's record
    assert steps[0].observation["exit_code"] == 0 and steps[0].generation == 1
    assert (row.verifier_outcome, row.verifier_name, row.termination_reason) == (
        "pass",
        "exists",
        "submitted",
    )
    assert row.cost > 0 and row.resources["exec_steps"] == 2
    assert row.sandbox_links.get().generation == 1


def _kill_agent(sandbox_id: str) -> None:
    row = Sandbox.objects.get(external_id=sandbox_id)
    meta = get_backend().sandboxes_dir / row.id.hex / "meta.json"  # type: ignore[attr-defined]
    os.kill(json.loads(meta.read_text())["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        watch_backend_once(timeout_s=1.0)
        row.refresh_from_db()
        if row.state == State.LOST:
            return
    raise AssertionError(f"watcher did not mark {sandbox_id} lost (it is {row.state})")


def test_it_classes_a_sandbox_killed_mid_episode_as_environment(live, make_tenant):
    _, secret = make_tenant()
    hr = _sdk(live, secret)
    sandbox = hr.create_sandbox()
    with pytest.raises(SandboxLost), sandbox.episode(task_id="long", model="m-1") as ep:
        sandbox.exec("echo before")
        _kill_agent(sandbox.id)
        sandbox.exec("echo after")
    row = Episode.objects.get(episode_id=ep.id)
    assert (row.status, row.termination_reason) == ("closed", "sandbox_lost")
    assert row.failure_class == "environment"
    decisive, fact = row.failure_evidence[0], row.failure_evidence[1]
    assert decisive["rule"] == "infra_fault_during_episode"
    assert (fact["source"], fact["reason"], fact["sandbox_id"]) == (
        "ledger",
        "backend_resource_gone",
        sandbox.id,
    )
    timeline = _http(live, secret).get(f"/episodes/{ep.id}/timeline").json()["results"]
    kinds = [(i["type"], i.get("to_state") or i.get("kind")) for i in timeline]
    assert ("event", "lost") in kinds
    assert kinds.index(("step", "exec")) < kinds.index(("event", "lost"))


def test_it_classes_truncated_observations_verifier_timeouts_and_inference(live, make_tenant):
    _, secret = make_tenant()
    http = _http(live, secret)
    with _sdk(live, secret) as hr, hr.create_sandbox() as sandbox:
        # The append API, as a harness in another language would use it.
        exec_url = f"/sandboxes/{sandbox.id}/exec"
        outcomes = {}
        for verdict in ("false", "true"):
            ep = http.post("/episodes", json={"task_id": "read-log", "sandbox_ids": [sandbox.id]})
            assert ep.status_code == 201, ep.text
            ep_id = ep.json()["id"]
            op_id, verify_id = f"op-big-{verdict}", f"op-verify-{verdict}"
            big = http.post(
                exec_url,
                json={"command": "seq 1 5000", "output_window": 256, "operation_id": op_id},
            )
            assert big.json()["output"]["stdout"]["truncated"] is True
            http.post(exec_url, json={"command": verdict, "operation_id": verify_id})
            steps = [
                {"kind": "exec", "sandbox_id": sandbox.id, "operation_id": op_id},
                {"kind": "verifier", "sandbox_id": sandbox.id, "operation_id": verify_id},
            ]
            assert http.post(f"/episodes/{ep_id}/steps", json={"steps": steps}).status_code == 201
            outcomes[verdict] = http.post(f"/episodes/{ep_id}/close", json={}).json()
        # Cut output and a failed verdict: the model may never have seen what it needed.
        assert outcomes["false"]["failure_class"] == "observation"
        assert outcomes["false"]["failure_evidence"][1]["operation_id"] == "op-big-false"
        # Cut output but the task was solved anyway: that is a success.
        assert outcomes["true"]["failure_class"] == "success"

        with sandbox.episode(task_id="slow-verifier") as slow:
            sandbox.exec("echo work")
            result = slow.verify("sleep 30", timeout=1)
        assert result.timed_out
        assert slow.failure_class == "verifier"
        assert Episode.objects.get(episode_id=slow.id).verifier_outcome == "timeout"

        with sandbox.episode(task_id="model-down") as down:
            sandbox.exec("echo work")
            down.set_result(inference_error={"status": 503, "message": "overloaded"})
        assert down.failure_class == "inference"
        assert down.data["valid"] is True


def test_it_classes_a_sandbox_that_never_became_ready_as_startup(live, make_tenant, tmp_path):
    _, secret = make_tenant()
    backend = get_backend()
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    # No python3 (refused with exec launch) and a /workspace bwrap cannot mount over
    # (zygote-started agents need no python3, but bwrap fails): never ready either way.
    os.symlink("/nonexistent", rootfs / "workspace")
    tarball = tmp_path / "nopython.tar"
    subprocess.run(["tar", "-cf", str(tarball), "-C", str(rootfs), "."], check=True)
    name = f"nopython-{os.getpid()}"
    backend.import_image(name, tarball)
    try:
        hr = _sdk(live, secret)
        http = _http(live, secret)
        created = http.post("/sandboxes", json={"image": name}).json()
        sandbox = hr.get(created["id"])
        ep = http.post("/episodes", json={"task_id": "t", "sandbox_ids": [sandbox.id]}).json()
        with pytest.raises(SandboxNotReady):
            sandbox.wait(timeout=60)
        closed = http.post(
            f"/episodes/{ep['id']}/close", json={"termination_reason": "harness_crash"}
        ).json()
    finally:
        shutil.rmtree(Path(backend.images_dir) / name, ignore_errors=True)  # type: ignore[attr-defined]
    assert closed["failure_class"] == "startup"
    fact = closed["failure_evidence"][1]
    assert (fact["source"], fact["reason"]) == ("ledger", "provision_error")
    assert Sandbox.objects.get(external_id=created["id"]).state == State.FAILED
