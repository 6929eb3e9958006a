"""Commands in the background and killing them (issue 26 defect 7): exec_stream starts
the command at the call, exec(background=True) returns a handle to wait for, kill,
read live or pick up again by id from another client, and the REST cancel endpoint."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hedgerow import AsyncClient, Client, WaitTimeout

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.05)


def test_it_starts_exec_stream_at_the_call_not_at_iteration(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        frames = sandbox.exec_stream(
            ["sh", "-c", "touch /workspace/started; sleep 60"], operation_id="op-eager-1"
        )
        # Not iterated: the command runs anyway.
        until(lambda: sandbox.exec("test -e /workspace/started").exit_code == 0)
        killed = sandbox.command("op-eager-1").kill()
        assert killed.termination == "cancelled" and killed.status != "running"
        last = list(frames)[-1]
        assert last.type == "exit" and last.result is not None
        assert last.result.termination == "cancelled"


def test_it_runs_waits_kills_and_reconnects_to_a_background_command(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        quick = sandbox.exec(["sh", "-c", "echo done; exit 4"], background=True)
        result = quick.wait(timeout=60)
        assert (result.exit_code, result.stdout) == (4, "done\n")

        handle = sandbox.exec(
            ["sh", "-c", "for i in 1 2 3; do echo line$i; done; sleep 120"], background=True
        )
        assert handle.running and handle.id.startswith("op-")
        seen = ""
        for frame in handle.output():
            seen += frame.text if frame.type == "stdout" else ""
            if "line3" in seen:
                break
        assert seen == "line1\nline2\nline3\n"
        with pytest.raises(WaitTimeout):
            handle.wait(timeout=0.3)

        # Another client (as another process would) picks it up by id.
        with Client(live.url, secret, cleanup=False) as other:
            again = other.get(sandbox.id).command(handle.id)
            assert again.refresh().running
            killed = again.kill()
        assert killed.termination == "cancelled"
        assert killed.stdout.startswith("line1\nline2\nline3\n")
        assert sandbox.operation(handle.id).termination == "cancelled"
        # Idempotent: a second kill answers the stored end.
        assert handle.kill().termination == "cancelled"
        assert sandbox.exec("pgrep -f 'sleep 120'").exit_code == 1


def test_it_cancels_through_rest_and_keeps_tenants_apart(live, make_tenant):
    tenant, secret = make_tenant()
    _, outsider = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        handle = sandbox.exec("sleep 120", background=True)
        url = f"{live.url}/api/v1/sandboxes/{sandbox.id}/operations/{handle.id}/cancel"
        foreign = httpx.post(url, headers={"Authorization": f"Bearer {outsider}"})
        assert foreign.status_code == 404
        assert handle.refresh().running
        mine = httpx.post(url, headers={"Authorization": f"Bearer {secret}"}, timeout=30)
        assert mine.status_code == 200, mine.text
        assert (mine.json()["status"], mine.json()["termination"]) != ("running", None)
        assert not handle.refresh().running
        missing = httpx.post(
            f"{live.url}/api/v1/sandboxes/{sandbox.id}/operations/op-nope/cancel",
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert missing.status_code == 404
        assert missing.json()["error"]["code"]


def test_it_does_the_same_in_the_async_client(live, make_tenant):
    tenant, secret = make_tenant()

    async def main() -> None:
        async with AsyncClient(live.url, secret) as hr:
            async with await hr.create_sandbox() as sandbox:
                handle = await sandbox.exec(["sh", "-c", "echo hi; sleep 120"], background=True)
                async for frame in handle:
                    if frame.type == "stdout":
                        assert frame.text == "hi\n"
                        break
                again = await sandbox.command(handle.id)
                assert (await again.kill()).termination == "cancelled"
                frames = sandbox.exec_stream(["sh", "-c", "touch /workspace/a; sleep 60"])
                deadline = time.monotonic() + 30
                while (await sandbox.exec("test -e /workspace/a")).exit_code != 0:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await frames.aclose()

    asyncio.run(main())


def test_it_starts_waits_for_and_kills_background_commands_from_the_cli(
    live, make_tenant, tmp_path
):
    tenant, secret = make_tenant()
    env = {**os.environ, "HEDGEROW_URL": live.url, "HEDGEROW_API_KEY": secret}
    env.update({"PYTHONPATH": str(SDK_DIR), "HEDGEROW_CONFIG": str(tmp_path / "none.json")})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", *args],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        started = cli("sandbox", "exec", "--background", sandbox.id, "--", "sh", "-c", "exit 5")
        assert started.returncode == 0, started.stderr
        op = started.stdout.strip()
        assert op.startswith("op-")
        waited = cli("ops", "wait", sandbox.id, op, "--timeout", "60")
        assert waited.returncode == 5, waited.stderr
        slow = cli("sandbox", "exec", "--background", sandbox.id, "--", "sleep", "120").stdout
        assert sandbox.command(slow.strip()).running
        killed = cli("ops", "kill", sandbox.id, slow.strip())
        assert "cancelled" in killed.stdout and killed.returncode != 0
        assert not sandbox.command(slow.strip()).running
