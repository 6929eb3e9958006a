"""Lifecycle, limits and filesystem isolation of the local backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local.cgroups import AGENT_MEMORY_RESERVE, AGENT_PIDS_RESERVE

from .conftest import REPO, Sandbox, make_config, needs_root, new_spec

pytestmark = needs_root


def traces(backend: LocalBackend, sid: str) -> list[str]:
    """Everything of ``sid`` still on the machine, checked directly (not via inventory)."""
    found = [f"inventory:{i.kind}:{i.name}" for i in backend.inventory() if i.sandbox_id == sid]
    if Path(f"/run/netns/{backend.names.netns(sid)}").exists():
        found.append("netns")
    if (
        subprocess.run(
            ["ip", "link", "show", backend.names.host_veth(sid)], capture_output=True
        ).returncode
        == 0
    ):
        found.append("veth")
    found += [f"cgroup:{p}" for p in backend.cgroups.paths(sid).values() if p.exists()]
    if (backend.sandboxes_dir / sid).exists():
        found.append("state dir")
    return found


def test_it_provisions_and_destroy_removes_every_trace(backend: LocalBackend) -> None:
    spec = new_spec()
    endpoint = backend.provision(spec)
    assert endpoint.isolation == "netns+bwrap" and endpoint.port == 7777
    assert wait_healthy(endpoint, spec.agent_token)["status"] == "ok"
    assert backend.endpoint(spec.sandbox_id) == endpoint
    kinds = {i.kind for i in backend.inventory() if i.sandbox_id == spec.sandbox_id}
    assert {"directory", "process", "address", "cgroup", "netns", "veth"} <= kinds
    meta = json.loads((backend.sandboxes_dir / spec.sandbox_id / "meta.json").read_text())
    pid = meta["pid"]

    backend.destroy(spec.sandbox_id)
    assert traces(backend, spec.sandbox_id) == []
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert backend.endpoint(spec.sandbox_id) is None
    backend.destroy(spec.sandbox_id)  # idempotent


def test_it_is_idempotent_per_generation(backend: LocalBackend) -> None:
    spec = new_spec()
    try:
        first = backend.provision(spec)
        pid = json.loads((backend.sandboxes_dir / spec.sandbox_id / "meta.json").read_text())["pid"]
        assert backend.provision(spec) == first
        assert (
            json.loads((backend.sandboxes_dir / spec.sandbox_id / "meta.json").read_text())["pid"]
            == pid
        )
        regen = new_spec(sandbox_id=spec.sandbox_id, generation=2, agent_token=spec.agent_token)
        second = backend.provision(regen)
        meta = json.loads((backend.sandboxes_dir / spec.sandbox_id / "meta.json").read_text())
        assert meta["generation"] == 2 and meta["pid"] != pid
        assert wait_healthy(second, spec.agent_token)["status"] == "ok"
    finally:
        backend.destroy(spec.sandbox_id)


def test_it_writes_and_enforces_cgroup_limits(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    if backend.cgroups.mode != "v1":
        pytest.skip("limits below are checked on cgroup v1")
    sb = sandbox_factory(memory_mib=128, cpu_millis=500, pids_limit=64)
    paths = backend.cgroups.paths(sb.id)
    # the spec's limits are the commands' (cmds/); the sandbox's own adds the agent's
    # headroom (cgroups.py), which only the agent's group (agent/) can use
    commands_memory, commands_pids = paths["memory"] / "cmds", paths["pids"] / "cmds"
    assert (commands_memory / "memory.limit_in_bytes").read_text().strip() == str(128 << 20)
    assert (paths["memory"] / "memory.limit_in_bytes").read_text().strip() == str(
        (128 << 20) + AGENT_MEMORY_RESERVE
    )
    assert (paths["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert (commands_pids / "pids.max").read_text().strip() == "64"
    assert (paths["pids"] / "pids.max").read_text().strip() == str(64 + AGENT_PIDS_RESERVE)
    meta = json.loads((backend.sandboxes_dir / sb.id / "meta.json").read_text())
    # the agent (and pause) are charged to the sandbox's own memory group, an inner node
    # beside cmds: one memory cgroup fewer per sandbox (cgroups.AGENT_OWN_GROUP)
    assert str(meta["pid"]) in (paths["memory"] / "cgroup.procs").read_text().split()
    assert sorted(p.name for p in paths["memory"].iterdir() if p.is_dir()) == ["cmds"]
    assert sorted(p.name for p in paths["pids"].iterdir() if p.is_dir()) == ["agent", "cmds"]
    assert str(meta["pid"]) in (paths["cpu"] / "cgroup.procs").read_text().split()

    hog = sb.exec(
        [
            "python3",
            "-c",
            "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')",
        ]
    )
    assert hog["termination"]["reason"] == "signaled", hog["termination"]
    assert hog["termination"]["signal"] in (9, "SIGKILL", "KILL"), hog["termination"]
    assert "survived" not in hog["stdout"]["head"]

    forks = sb.exec(
        [
            "python3",
            "-c",
            textwrap.dedent("""
        import subprocess
        ps = []
        try:
            for _ in range(100):
                ps.append(subprocess.Popen(["sleep", "5"]))
        except OSError as e:
            print("limited", len(ps))
        for p in ps:
            p.kill()
    """),
        ]
    )
    assert forks["stdout"]["head"].startswith("limited"), forks
    assert wait_healthy(sb.endpoint, sb.spec.agent_token, timeout=5)["status"] == "ok"


def test_it_isolates_the_filesystem_and_drops_capabilities(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    a, b = sandbox_factory(), sandbox_factory()
    assert a.sh("echo secret-a > /workspace/mine && cat /workspace/mine")[1] == "secret-a\n"
    assert a.sh("echo t > /tmp/t && cat /tmp/t")[1] == "t\n"
    assert b.sh("ls -A /workspace /tmp")[1].split() == ["/tmp:", "/workspace:"]
    for path in ("/x", "/usr/x", "/etc/x", "/opt/hedgerow/podagent/x", "/bin/x"):
        code, _, err = a.sh(f"touch {path}")
        assert code != 0, (path, err)
    assert a.sh("grep CapEff /proc/self/status")[1].split() == ["CapEff:", "0000000000000000"]
    # the token was consumed: not on disk, not in the environment
    code, out, _ = a.sh("ls -A /run/hedgerow; env")
    assert a.spec.agent_token not in out and "PYTHONPATH" not in out
    assert not (a.backend.sandboxes_dir / a.id / "secret").exists()  # never on the host
    # pid namespace: only the sandbox's own processes
    assert int(a.sh("ls /proc | grep -c '^[0-9]'")[1]) < 10


def test_it_cleans_a_provision_killed_halfway(backend: LocalBackend) -> None:
    spec = new_spec()
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from apps.sandboxes.backends.local import LocalBackend
        from apps.sandboxes.backends.tests.conftest import make_config, new_spec
        from pathlib import Path
        b = LocalBackend(make_config(Path({str(backend.config.state_dir.parent)!r}),
                                     {backend.config.instance!r}, "netns"))
        def die(point):
            if point == "veth_created":
                os.kill(os.getpid(), signal.SIGKILL)
        b.fault_hook = die
        b.provision(new_spec(sandbox_id={spec.sandbox_id!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = traces(backend, spec.sandbox_id)
    assert "netns" in left and "veth" in left and "state dir" in left
    backend.destroy(spec.sandbox_id)
    assert traces(backend, spec.sandbox_id) == []


def test_it_rolls_back_when_provision_fails(backend: LocalBackend) -> None:
    spec = new_spec()

    def fail(point: str) -> None:
        if point == "cgroups_created":
            raise RuntimeError("injected")

    backend.fault_hook = fail
    try:
        with pytest.raises(BackendError, match="injected"):
            backend.provision(spec)
    finally:
        backend.fault_hook = None
    assert traces(backend, spec.sandbox_id) == []


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def test_it_kills_what_a_started_sandbox_left_running(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    if not backend.cgroups.parents:
        pytest.skip("no writable cgroups")
    sb = sandbox_factory()
    # a daemon of its own session, outside the agent's process tree
    code, _, err = sb.sh("setsid sh -c 'sleep 1000 & sleep 1000' </dev/null >/dev/null 2>&1 &")
    assert code == 0, err
    procs = backend.cgroups.paths(sb.id)["cpu"] / "cgroup.procs"  # not split: everyone
    deadline = time.monotonic() + 10
    while procs.read_text().count("\n") < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in procs.read_text().split()]
    assert len(pids) >= 5  # bwrap ×2, agent, sh, 2 × sleep
    backend.destroy(sb.id)
    assert [p for p in pids if not _dead(p)] == []
    assert traces(backend, sb.id) == []


def test_it_kills_what_a_failed_provision_left_in_its_netns(backend: LocalBackend) -> None:
    spec = new_spec()
    ns = backend.names.netns(spec.sandbox_id)
    intruder: list[subprocess.Popen[bytes]] = []

    def enter_then_fail(point: str) -> None:
        if point == "veth_created":
            # not in any cgroup of the sandbox: only the netns scan can find it
            intruder.append(subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "1000"]))
            deadline = time.monotonic() + 10
            while not backend.network.netns_pids(spec.sandbox_id):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            raise RuntimeError("injected")

    backend.fault_hook = enter_then_fail
    try:
        with pytest.raises(BackendError, match="injected"):
            backend.provision(spec)
        assert intruder[0].wait(timeout=10) == -signal.SIGKILL
    finally:
        backend.fault_hook = None
        for proc in intruder:
            proc.kill()
            proc.wait()
    assert traces(backend, spec.sandbox_id) == []


def test_it_survives_the_death_of_the_provisioning_process(backend: LocalBackend) -> None:
    spec = new_spec()
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from apps.sandboxes.backends.local import LocalBackend
        from apps.sandboxes.backends.tests.conftest import make_config, new_spec
        from pathlib import Path
        b = LocalBackend(make_config(Path({str(backend.config.state_dir.parent)!r}),
                                     {backend.config.instance!r}, "netns"))
        b.provision(new_spec(sandbox_id={spec.sandbox_id!r}, agent_token={spec.agent_token!r}))
        print("provisioned", flush=True)
        time.sleep(60)
    """)
    # the "worker" leads its own process group, like a Celery child killed by group
    worker = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "provisioned"
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        time.sleep(0.5)
        endpoint = backend.endpoint(spec.sandbox_id)
        assert endpoint is not None
        assert wait_healthy(endpoint, spec.agent_token, timeout=10)["status"] == "ok"
    finally:
        worker.kill()
        backend.destroy(spec.sandbox_id)


def test_it_reports_a_dead_agent_as_gone(backend: LocalBackend) -> None:
    spec = new_spec()
    try:
        backend.provision(spec)
        assert list(backend.watch(0.1)) == []
        pid = json.loads((backend.sandboxes_dir / spec.sandbox_id / "meta.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        events = list(backend.watch(3))
        assert [(e.sandbox_id, e.kind, e.generation) for e in events] == [
            (spec.sandbox_id, "gone", 1)
        ]
        assert backend.endpoint(spec.sandbox_id) is None
        # the pid namespace dies with its bwrap: nothing left in the netns (the kernel
        # reaps the namespace's processes asynchronously, so allow it a moment)
        deadline = time.monotonic() + 10
        while backend.network.netns_pids(spec.sandbox_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.network.netns_pids(spec.sandbox_id) == []
    finally:
        backend.destroy(spec.sandbox_id)


def test_it_reclaims_each_inventory_item(backend: LocalBackend) -> None:
    spec = new_spec()
    backend.provision(spec)
    items = [i for i in backend.inventory() if i.sandbox_id == spec.sandbox_id]
    for item in sorted(items, key=lambda i: i.kind != "process"):
        backend.reclaim(item)
    assert traces(backend, spec.sandbox_id) == []


def test_it_never_lists_another_instances_resources(backend: LocalBackend, tmp_path: Path) -> None:
    other = LocalBackend(make_config(tmp_path, f"{backend.config.instance}-x", "netns"))
    spec = new_spec()
    try:
        other.provision(spec)
        assert other.network.subnet != backend.network.subnet
        assert all(i.sandbox_id != spec.sandbox_id for i in backend.inventory())
        assert {i.sandbox_id for i in other.inventory()} == {spec.sandbox_id}
    finally:
        other.teardown_instance()
    assert other.inventory() == []


def test_it_falls_back_to_an_unisolated_process(tmp_path: Path) -> None:
    b = LocalBackend(make_config(tmp_path, f"u{os.getpid()}", "none"))
    spec = new_spec()
    try:
        endpoint = b.provision(spec)
        assert endpoint.isolation == "none" and endpoint.host == "127.0.0.1"
        assert wait_healthy(endpoint, spec.agent_token)["status"] == "ok"
        sb = Sandbox(b, spec, endpoint)
        code, out, _ = sb.sh("pwd; echo $PYTHONPATH")
        assert code == 0 and out.split("\n")[0].endswith("workspace")
        assert out.split("\n")[1] == ""
        assert b.provision(spec) == endpoint
    finally:
        b.destroy(spec.sandbox_id)
    assert b.inventory() == []
    b.teardown_instance()
