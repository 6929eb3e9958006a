"""Issue 22 item 1: a verifier that did not run is ``verifier``, not the policy failing;
the policy's own failures seen through a verifier stay ``task``. Real sandboxes, real
commands: the exit codes come from the shell and Python in the sandbox."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from hedgerow import Client, HedgerowError
from hedgerow.aio import AsyncClient
from hedgerow.streaming import Frame

from apps.sandboxes.models import Sandbox, State
from apps.trajectories.models import Episode

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _settled(live):
    yield
    deadline = time.monotonic() + 60
    busy = (State.REQUESTED, State.PROVISIONING, State.TERMINATING)
    while Sandbox.objects.filter(state__in=busy).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _sdk(live, secret: str) -> Client:
    return Client(url=live.url, api_key=secret, max_retries=1, timeout=90)


def test_a_verifier_that_did_not_run_is_verifier_and_the_policys_failures_stay_task(
    live, make_tenant
):
    _, secret = make_tenant()
    cases: dict[str, tuple[str, str | list[str], str]] = {
        # (setup, verifier command, kind) -> expected class
        "not-found": ("true", "/workspace/no-such-verifier", "custom"),
        "not-executable": (
            "printf 'exit 0' > /workspace/v.sh && chmod -x /workspace/v.sh",
            "/workspace/v.sh",
            "custom",
        ),
        "no-tests-collected": ("true", ["python3", "-c", "raise SystemExit(5)"], "pytest"),
        "usage-error": ("true", ["python3", "-c", "raise SystemExit(4)"], "pytest"),
        # Counter-cases: the policy's code does not even parse; the policy wrote no
        # answer so the verifier's read raises. Both are the policy's failure.
        "policy-syntax-error": (
            "printf 'def f(:\\n' > /workspace/solution.py",
            ["python3", "-c", "import sys; sys.path.insert(0, '/workspace'); import solution"],
            "custom",
        ),
        "no-answer-file": (
            "rm -f /workspace/answer",
            ["python3", "-c", "open('/workspace/answer').read()"],
            "custom",
        ),
        "pytest-interrupted": ("true", ["python3", "-c", "raise SystemExit(2)"], "pytest"),
    }
    classes, outcomes = {}, {}
    with _sdk(live, secret) as hr, hr.create_sandbox() as sandbox:
        for name, (setup, command, kind) in cases.items():
            with sandbox.episode(task_id=name) as ep:
                sandbox.exec(setup)
                result = ep.verify(command, timeout=30, kind=kind)
            classes[name] = ep.failure_class
            outcomes[name] = (result.exit_code, Episode.objects.get(episode_id=ep.id))
    assert classes == {
        "not-found": "verifier",
        "not-executable": "verifier",
        "no-tests-collected": "verifier",
        "usage-error": "verifier",
        "policy-syntax-error": "task",
        "no-answer-file": "task",
        "pytest-interrupted": "task",
    }
    assert outcomes["not-found"][0] == 127 and outcomes["not-executable"][0] == 126
    row = outcomes["no-tests-collected"][1]
    assert row.verifier_outcome == "error"
    decisive, fact = row.failure_evidence[0], row.failure_evidence[1]
    assert decisive["rule"] == "verifier_error"
    assert (fact["source"], fact["verifier_kind"]) == ("operation", "pytest")
    assert "no tests collected" in fact["detail"]
    step = row.steps.get(kind="verifier")
    assert step.verifier == {"kind": "pytest"} and step.operation_record is not None


def test_the_operation_record_beats_a_client_that_reports_fail_or_verifier_error(live, make_tenant):
    _, secret = make_tenant()
    http = httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )
    with _sdk(live, secret) as hr, hr.create_sandbox() as sandbox:
        closed = {}
        for name, command, body in (
            ("missing", "/no/such/verifier", {"verifier_outcome": "fail"}),
            ("explicit", "true", {"termination_reason": "verifier_error"}),
        ):
            ep = http.post("/episodes", json={"task_id": name, "sandbox_ids": [sandbox.id]})
            op_id = f"op-verify-{name}"
            ran = http.post(
                f"/sandboxes/{sandbox.id}/exec", json={"command": command, "operation_id": op_id}
            )
            assert ran.status_code == 200, ran.text
            step = {"kind": "verifier", "sandbox_id": sandbox.id, "operation_id": op_id}
            appended = http.post(f"/episodes/{ep.json()['id']}/steps", json={"steps": [step]})
            assert appended.status_code == 201, appended.text
            closed[name] = http.post(f"/episodes/{ep.json()['id']}/close", json=body).json()
    assert closed["missing"]["failure_class"] == "verifier"
    assert closed["explicit"]["failure_class"] == "verifier"
    bad = http.post("/episodes", json={"task_id": "k"}).json()
    refused = http.post(
        f"/episodes/{bad['id']}/steps",
        json={"steps": [{"kind": "verifier", "verifier": {"kind": "mocha"}}]},
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["field"].startswith("steps")


def test_a_sandbox_deleted_by_another_client_mid_episode_is_environment(live, make_tenant):
    _, secret = make_tenant()
    with _sdk(live, secret) as hr, _sdk(live, secret) as other:
        sandbox = hr.create_sandbox()
        with pytest.raises(HedgerowError) as raised, sandbox.episode(task_id="t") as ep:
            sandbox.exec("echo work")
            other.get(sandbox.id).delete()
            ep.verify("true", timeout=10)
    assert raised.value.code in ("sandbox_terminating", "sandbox_deleted")
    row = Episode.objects.get(episode_id=ep.id)
    assert (row.termination_reason, row.failure_class) == ("sandbox_lost", "environment")
    fact = row.failure_evidence[1]
    assert (fact["source"], fact["reason"]) == ("ledger", "deleted")
    # The refused verifier exec is recorded as a step, with the refusal.
    verifier = row.steps.get(kind="verifier")
    assert verifier.observation["error"]["code"] == raised.value.code
    assert verifier.verifier == {"kind": "custom"} and verifier.operation_record is None


JUNIT = (
    '<testsuites><testsuite name="s" tests="3">'
    '<testcase classname="tests.test_a" name="test_ok"/>'
    '<testcase classname="tests.test_a" name="test_bad"><failure message="no"/></testcase>'
    '<testcase classname="tests.test_a" name="test_later"><skipped/></testcase>'
    "</testsuite></testsuites>"
)


def test_a_junit_report_gives_the_per_test_vector_and_the_verdict(live, make_tenant):
    _, secret = make_tenant()
    writes = "import sys; open('/workspace/r.xml', 'w').write(sys.argv[1]); sys.exit(1)"
    zero = '<testsuite tests="0"></testsuite>'
    with _sdk(live, secret) as hr, hr.create_sandbox() as sandbox:
        with sandbox.episode(task_id="reported") as reported:
            reported.verify(["python3", "-c", writes, JUNIT], kind="pytest",
                            report="/workspace/r.xml", timeout=30)  # fmt: skip
        with sandbox.episode(task_id="no-report") as crashed:
            sandbox.exec("rm -f /workspace/r.xml")
            # A verifier that dies on its own import before writing its report.
            crashed.verify(["python3", "-c", "import no_such_verifier_lib"], kind="pytest",
                           report="/workspace/r.xml", timeout=30)  # fmt: skip
        with sandbox.episode(task_id="zero") as empty:
            empty.verify(["python3", "-c", writes, zero], kind="junit-xml",
                         report="/workspace/r.xml", timeout=30)  # fmt: skip
    row = Episode.objects.get(episode_id=reported.id)
    assert row.failure_class == "task"
    step = row.steps.get(kind="verifier")
    assert step.verifier["results"] == {
        "tests.test_a::test_ok": "passed",
        "tests.test_a::test_bad": "failed",
        "tests.test_a::test_later": "skipped",
    }
    assert step.verifier["summary"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert "report: 1 passed, 1 failed" in row.failure_evidence[1]["detail"]
    assert "report" not in step.verifier["report"]  # the text itself is not kept
    assert crashed.failure_class == "verifier"
    no_report = Episode.objects.get(episode_id=crashed.id).failure_evidence[1]["detail"]
    assert "no valid report: the verifier wrote no report" in no_report
    assert empty.failure_class == "verifier"
    assert (
        "no executed test" in Episode.objects.get(episode_id=empty.id).failure_evidence[1]["detail"]
    )


def test_exec_stream_inside_an_episode_is_recorded_as_a_step(live, make_tenant):
    _, secret = make_tenant()
    with _sdk(live, secret) as hr, hr.create_sandbox() as sandbox:
        with sandbox.episode(task_id="streamed") as ep:
            frames = list(sandbox.exec_stream("echo streamed; exit 3"))
            ep.verify("true", timeout=10)
    exit_frame = frames[-1]
    assert exit_frame.type == "exit" and exit_frame.result is not None
    assert exit_frame.result.exit_code == 3
    row = Episode.objects.get(episode_id=ep.id)
    step = row.steps.get(index=0)
    assert step.kind == "exec" and step.operation_record is not None
    assert step.observation["exit_code"] == 3
    assert step.action == "echo streamed; exit 3"


def test_the_async_client_records_episodes_too(live, make_tenant):
    _, secret = make_tenant()

    async def run() -> tuple[str, str]:
        async with AsyncClient(live.url, secret) as aclient:
            async with await aclient.create_sandbox() as sandbox:
                async with sandbox.episode(task_id="async", model="m-1") as ep:
                    await sandbox.exec("echo hi > /workspace/answer")
                    ep.step(action="done", kind="model")
                    await ep.verify("/workspace/missing-verifier", timeout=10)
                return ep.id, ep.failure_class

    episode_id, failure_class = asyncio.run(run())
    assert failure_class == "verifier"
    row = Episode.objects.get(episode_id=episode_id)
    assert [s.kind for s in row.steps.all()] == ["exec", "model", "verifier"]
    assert row.steps.get(index=0).operation_record is not None
    assert row.verifier_outcome == "error"


def test_the_async_client_records_exec_stream_and_apply_patch_steps(live, make_tenant):
    # The async flavour once recorded neither (sdk/tests/test_sync_is_unasync.py now
    # holds the two flavours to the same code).
    _, secret = make_tenant()
    patch = "--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"

    async def run() -> tuple[str, list[Frame]]:
        async with AsyncClient(live.url, secret) as aclient:
            async with await aclient.create_sandbox() as sandbox:
                await sandbox.write_file("/workspace/app.py", "x = 1\n")
                async with sandbox.episode(task_id="async-stream") as ep:
                    frames = [f async for f in sandbox.exec_stream("echo streamed; exit 3")]
                    assert (await sandbox.apply_patch(patch)).ok
                return ep.id, frames

    episode_id, frames = asyncio.run(run())
    exit_frame = frames[-1]
    assert exit_frame.type == "exit" and exit_frame.result is not None
    row = Episode.objects.get(episode_id=episode_id)
    steps = list(row.steps.order_by("index"))
    assert [s.action for s in steps] == ["echo streamed; exit 3", "apply_patch"]
    assert all(s.kind == "exec" and s.operation_record is not None for s in steps)
    assert steps[0].observation["exit_code"] == 3
