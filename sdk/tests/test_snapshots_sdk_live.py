"""``sb.snapshot()`` and ``client.fork()`` against the real stack (issue 16)."""

from __future__ import annotations

import hedgerow
import pytest
from hedgerow import Client

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox

pytestmark = pytest.mark.timeout(240)


def test_it_snapshots_and_forks_through_the_sync_client(live, make_tenant):
    _, secret = make_tenant()
    with Client(live.url, secret) as hr:
        parent = hr.create_sandbox()
        parent.write_file("/workspace/state.txt", b"turn 3\n")
        snap = parent.snapshot(
            name="turn-3",
            manifest={"messages": ["hi"], "seed": 1},
            probes=[{"name": "state", "command": "cat /workspace/state.txt"}],
        )
        assert isinstance(snap, hedgerow.Snapshot) and snap.state == "ready"
        assert snap.fingerprint["probes"]["state"]["stdout"] == "turn 3\n"
        assert snap.manifest == {"messages": ["hi"], "seed": 1}
        assert [s.id for s in hr.snapshots()] == [snap.id]

        children = hr.fork(snap, n=3, idempotency_key="sdk-fork")
        assert [c.state for c in children] == ["ready"] * 3
        for child in children:
            assert child.read_file("/workspace/state.txt") == b"turn 3\n"
        again = hr.fork(snap, n=3, idempotency_key="sdk-fork")  # a retry: the same three
        assert [c.id for c in again] == [c.id for c in children]
        one = hr.create_sandbox(from_snapshot=snap)
        assert one.data["from_snapshot"] == snap.id
        assert one.read_file("/workspace/state.txt") == b"turn 3\n"
        assert Sandbox.objects.filter(snapshot_id=snap.id).count() == 4

        parent.delete()
        dead = hr.create_sandbox()
        get_backend().destroy(Sandbox.objects.get(external_id=dead.id).id.hex)
        with pytest.raises(hedgerow.SnapshotFailed) as caught:
            dead.snapshot()
        assert caught.value.code == "sandbox_not_running"
        snap.delete()
        assert snap.state == "deleted"
        with pytest.raises(hedgerow.Conflict):
            hr.fork(snap, n=1)


def test_the_async_client_snapshots_and_forks(live, make_tenant):
    import asyncio

    from hedgerow import AsyncClient

    _, secret = make_tenant()

    async def main() -> tuple[str, list[bytes], str]:
        async with AsyncClient(live.url, secret) as hr:
            parent = await hr.create_sandbox()
            await parent.write_file("/workspace/a.txt", b"async state\n")
            snap = await parent.snapshot(probes=[{"command": "cat /workspace/a.txt"}])
            children = await hr.fork(snap, n=2)
            contents = [await c.read_file("/workspace/a.txt") for c in children]
            listed = await hr.snapshots()
            await snap.delete()
            return snap.fingerprint["probes"]["probe0"]["stdout"], contents, listed[0].id

    stdout, contents, listed = asyncio.run(main())
    assert stdout == "async state\n"
    assert contents == [b"async state\n"] * 2
    assert Sandbox.objects.filter(snapshot_id=listed).count() == 2


def test_the_cli_creates_lists_forks_and_removes_snapshots(live, make_tenant, tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    sdk_dir = Path(__file__).resolve().parents[1]
    _, secret = make_tenant()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEDGEROW_")}
    env.update({"HEDGEROW_URL": live.url, "HEDGEROW_API_KEY": secret, "PYTHONPATH": str(sdk_dir)})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", *args],
            env=env,
            input="",
            capture_output=True,
            text=True,
            timeout=180,
        )

    with Client(live.url, secret) as hr:
        parent = hr.create_sandbox()
        parent.write_file("/workspace/cli.txt", b"from the cli\n")
        manifest = tmp_path / "manifest.json"
        manifest.write_text(json.dumps({"seed": 3}))
        made = cli(
            "--json", "snapshot", "create", parent.id, "--name", "cli",
            "--manifest", str(manifest), "--probe", "cat /workspace/cli.txt",
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        snap = json.loads(made.stdout)
        assert (snap["state"], snap["name"], snap["manifest"]) == ("ready", "cli", {"seed": 3})
        listed = cli("snapshot", "ls")
        assert listed.returncode == 0 and snap["id"] in listed.stdout
        forked = cli("snapshot", "fork", snap["id"], "2")
        assert forked.returncode == 0, forked.stderr
        ids = forked.stdout.split()
        assert len(ids) == 2
        for sandbox_id in ids:
            assert hr.get(sandbox_id).read_file("/workspace/cli.txt") == b"from the cli\n"
            hr.delete(sandbox_id)
        removed = cli("snapshot", "rm", snap["id"])
        assert removed.returncode == 0, removed.stderr
        assert hr.get_snapshot(snap["id"]).state == "deleted"
        missing = cli("snapshot", "rm", "00000000-0000-0000-0000-000000000000")
        assert missing.returncode == 1 and "snapshot_not_found" in missing.stderr


def test_the_sdk_and_cli_pause_and_resume(live, make_tenant):
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, secret = make_tenant()
    with Client(live.url, secret) as hr:
        sb = hr.create_sandbox()
        sb.write_file("/workspace/p.txt", b"before the pause\n")
        assert sb.pause().state == "paused"
        with pytest.raises(hedgerow.SandboxNotReady):
            sb.exec("true")
        assert sb.resume().state == "ready"  # retried while the pause is being captured
        assert sb.generation == 2
        assert sb.read_file("/workspace/p.txt") == b"before the pause\n"

        env = {k: v for k, v in os.environ.items() if not k.startswith("HEDGEROW_")}
        env.update(
            {
                "HEDGEROW_URL": live.url,
                "HEDGEROW_API_KEY": secret,
                "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            }
        )

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "hedgerow.cli", *args],
                env=env, input="", capture_output=True, text=True, timeout=180,
            )  # fmt: skip

        paused = cli("sandbox", "pause", sb.id)
        assert paused.returncode == 0 and "paused" in paused.stdout, paused.stderr
        resumed = cli("sandbox", "resume", sb.id)
        assert resumed.returncode == 0 and "ready gen=3" in resumed.stdout, resumed.stderr
        assert sb.refresh().read_file("/workspace/p.txt") == b"before the pause\n"
