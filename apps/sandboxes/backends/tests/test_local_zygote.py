"""Agents forked from the zygote (zygote/daemon.py) into real sandboxes: every agent
feature works, the agent has no more privilege or visibility than an exec-started one,
its death still ends the sandbox, and the zygote's own death touches no sandbox."""

from __future__ import annotations

import fcntl
import functools
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import zygote.daemon as zygote_daemon
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local import LocalBackend, process, wait_healthy
from apps.sandboxes.backends.local._sys import is_alive, proc_start_time
from apps.sandboxes.backends.local.storage import qgroup_of
from apps.sandboxes.backends.local.zygote import ZygoteUnavailable, source_version

from .conftest import PODAGENT, Sandbox, make_config, needs_root, new_spec

pytestmark = needs_root

O_CLOEXEC = 0o2000000


def until(predicate: Callable[[], bool], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def status_fields(text: str, prefixes: tuple[str, ...]) -> dict[str, str]:
    fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return {k: v.strip() for k, v in fields.items() if k.startswith(prefixes)}


def host_status(pid: int) -> dict[str, str]:
    return status_fields(
        Path(f"/proc/{pid}/status").read_text(), ("Cap", "NoNewPrivs", "N", "PPid")
    )


@pytest.fixture
def exec_sandbox(backend: LocalBackend) -> Iterator[Sandbox]:
    """A sandbox of the same instance whose agent is bwrap's payload, for comparison."""
    exec_backend = LocalBackend(
        replace(backend.config, agent_launch="exec", allow_unprotected_exec_launch=True)
    )
    spec = new_spec()
    endpoint = exec_backend.provision(spec)
    try:
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        yield Sandbox(exec_backend, spec, endpoint)
    finally:
        exec_backend.destroy(spec.sandbox_id)


def meta(sb: Sandbox) -> dict[str, Any]:
    data = sb.backend._meta(sb.id)
    assert data is not None
    return data


def test_it_uses_the_zygote_by_default_and_records_the_sandbox_pid_1(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    sb = sandbox_factory()
    m = meta(sb)
    assert sb.backend.agent_launch == "zygote"
    assert m["launch"] == "zygote"
    # the recorded pid is the sandbox's init (pid 1 inside): pause (bwrap --as-pid-1),
    # bwrap's child
    assert Path(f"/proc/{m['pid']}/comm").read_text().strip() == "pause"
    assert host_status(m["pid"])["NSpid"].split()[-1] == "1"
    assert host_status(m["pid"])["PPid"] == str(m["bwrap_pid"])
    agent = host_status(m["agent_pid"])
    assert agent["Name"] == "hedgerow-agent"
    assert len(agent["NSpid"].split()) == 2, "the agent is in the sandbox's pid namespace"
    code, out, _ = sb.sh("hostname; cat /proc/1/comm /proc/2/comm")
    assert (code, out) == (0, "sandbox\npause\nhedgerow-agent\n")


def test_an_idle_agent_copies_no_pages_for_lookups_or_finders_it_never_uses(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    """Issue 20, memory per idle sandbox: a forked agent's private pages are what it
    (and its handler) wrote of the zygote's. Three writers were avoidable: HTTPServer's
    getfqdn of the agent's own address (NSS modules loaded), the handler's first
    unicode_escape lookup (a module imported), and freeing the host's import finders
    (sys.path_importer_cache cleared). Checked here: no NSS module mapped, and the
    agent's USS (after one exec) below what it was with them."""
    sb = sandbox_factory()
    assert sb.sh("true")[0] == 0
    agent = meta(sb)["agent_pid"]
    maps = Path(f"/proc/{agent}/maps").read_text()
    assert "libnss_" not in maps
    uss = sum(
        int(line.split()[1])
        for line in Path(f"/proc/{agent}/smaps_rollup").read_text().splitlines()
        if line.startswith(("Private_Clean:", "Private_Dirty:"))
    )
    # measured 4.2-4.5 MiB; 4.75-5.0 MiB before those three (docs/benchmarks.md "Density")
    assert uss < 4700, f"agent USS {uss} KiB"


def test_it_gives_the_agent_no_more_privilege_or_visibility_than_exec(
    sandbox_factory: Callable[..., Sandbox], exec_sandbox: Sandbox
) -> None:
    zb = sandbox_factory()
    assert meta(exec_sandbox)["launch"] == "exec"
    caps = "grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status"
    zcaps = status_fields(zb.sh(caps)[1], ("Cap", "NoNewPrivs", "Seccomp"))
    ecaps = status_fields(exec_sandbox.sh(caps)[1], ("Cap", "NoNewPrivs", "Seccomp"))
    assert zcaps.keys() == ecaps.keys() and len(zcaps) >= 7
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(zcaps[key], 16) == 0, (key, zcaps)
        assert int(zcaps[key], 16) & ~int(ecaps[key], 16) == 0, key  # a subset of exec's
    assert zcaps["NoNewPrivs"] == ecaps["NoNewPrivs"] == "1"
    assert zcaps["Seccomp"] == ecaps["Seccomp"]
    agent = host_status(meta(zb)["agent_pid"])  # the agent itself, seen from the host
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(agent[key], 16) == 0, (key, agent)
    assert agent["NoNewPrivs"] == "1"

    # in the sandbox's cgroups, seen from the host
    cgroups = Path(f"/proc/{meta(zb)['agent_pid']}/cgroup").read_text().splitlines()
    # (pids: the agent's own group, beside its commands'; memory: the sandbox's, whose
    # child the commands' is: cgroups.py)
    for controller, leaf in (("memory", ""), ("cpu", ""), ("pids", "/agent")):
        (line,) = [c for c in cgroups if controller in c.split(":")[1].split(",")]
        assert line.endswith(f"/{zb.id}{leaf}"), line
    # commands cannot read the agent's memory map, environ or binary (exec's can)
    for what in ("maps", "environ", "exe"):
        code, _, err = zb.sh(f"cat /proc/$PPID/{what} >/dev/null")
        assert code != 0 and "denied" in err, (what, err)

    # the same environment, cgroup view, hostname and fds for commands
    for command in ("env | sort", "cat /proc/self/cgroup", "hostname", "ls /proc/self/fd"):
        assert zb.sh(command) == exec_sandbox.sh(command), command
    assert zb.sh("ls /proc/self/fd")[1] == "0\n1\n2\n3\n"  # 3: ls's own directory

    # the same mounts, but the pause binary and the commands' exec helper instead of the
    # agent's sources
    mounts = "cut -d' ' -f2 /proc/self/mounts | sort"
    zmounts = set(zb.sh(mounts)[1].split())
    emounts = set(exec_sandbox.sh(mounts)[1].split())
    ours = {"/opt/hedgerow/pause", "/opt/hedgerow/exec"}
    assert zmounts == (emounts - {"/opt/hedgerow/podagent"}) | ours
    # the interpreter the agent runs (the control plane's) is not visible in the sandbox
    for path in {os.path.realpath(sys.executable), str(PODAGENT)}:
        assert zb.sh(f"test -e {path}; echo $?")[1] == "1\n", path
    # nothing of the host's state or settings in what the sandbox can read of its agent
    # (bwrap's own command line, pid 1, shows the bind sources in both modes)
    agent_view = zb.sh(
        "for p in /proc/[0-9]*; do [ $(cat $p/comm) = hedgerow-agent ] || continue; "
        "tr '\\0' ' ' <$p/cmdline; tr '\\0' ' ' <$p/environ; done"
    )[1]
    assert "zygote.daemon" in agent_view
    assert str(zb.backend.config.state_dir) not in agent_view
    assert "HEDGEROW_" not in agent_view


def test_it_leaves_the_agent_only_its_log_listener_and_the_hold_pipe(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    sb = sandbox_factory()
    m = meta(sb)
    agent, pause = m["agent_pid"], int(m["pid"])  # pause is the sandbox's pid 1

    def agent_fds() -> dict[int, str]:
        return {
            int(fd): os.readlink(f"/proc/{agent}/fd/{fd}") for fd in os.listdir(f"/proc/{agent}/fd")
        }

    # wait_healthy's connection may still be closing: wait for the idle agent
    until(lambda: sum(t.startswith("socket:") for t in agent_fds().values()) == 1, "idle agent")
    fds = agent_fds()
    log = str(sb.backend._dir(sb.id) / "agent.log")
    assert (fds[0], fds[1], fds[2]) == ("/dev/null", log, log)
    pipes = [fd for fd, target in fds.items() if target.startswith("pipe:")]
    hold = os.readlink(f"/proc/{pause}/fd/4")
    assert [fds[fd] for fd in pipes] == [hold], fds  # the hold pipe only
    flags = Path(f"/proc/{agent}/fdinfo/{pipes[0]}").read_text().split("flags:")[1].split()[0]
    assert int(flags, 8) & O_CLOEXEC, "commands must never inherit the hold pipe"
    tcp = Path(f"/proc/{agent}/net/tcp").read_text() + Path(f"/proc/{agent}/net/tcp6").read_text()
    host_unix = Path("/proc/self/net/unix").read_text()  # the zygote's sockets are there
    for fd, target in fds.items():
        if target.startswith("socket:"):
            inode = target[len("socket:[") : -1]
            assert f" {inode} " in tcp, f"fd {fd} is not the agent's TCP listener"
            assert f" {inode} " not in host_unix
        elif fd > 2 and fd not in pipes:
            # the JSON log opened at /dev/stdout, epoll, and the sandbox's own cgroup
            # files its launcher opened for it (podagent/limits.py), close-on-exec
            cgroup_file = target.startswith("/sys/fs/cgroup/") and f"/{sb.id}/" in target
            # and its disk quota group's counters (the disk exhaustion kind): read-only
            # sysfs files of its own group, named by the sandbox's qgroup id
            qgroup = qgroup_of(sb.id)
            quota_file = target.startswith("/sys/fs/btrfs/") and (
                f"/qgroups/{qgroup >> 48}_{qgroup & ((1 << 48) - 1)}/" in target
            )
            assert target == log or target.startswith("anon_inode:") or cgroup_file or quota_file, (
                fd,
                target,
            )
            if cgroup_file or quota_file:
                flags = Path(f"/proc/{agent}/fdinfo/{fd}").read_text().split("flags:")[1]
                assert int(flags.split()[0], 8) & O_CLOEXEC, target
    # pause holds nothing but its pipe; the zygote gave it nothing else either
    pause_fds = {
        int(fd): os.readlink(f"/proc/{pause}/fd/{fd}") for fd in os.listdir(f"/proc/{pause}/fd")
    }
    assert sorted(pause_fds) == [0, 1, 2, 4]


def test_it_serves_exec_streams_files_and_ptys_without_late_imports(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    sb = sandbox_factory()
    ep, token = sb.endpoint, sb.spec.agent_token
    headers = {"Authorization": f"Bearer {token}"}
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=30)
    conn.request("PUT", "/files?path=/workspace/a%20b.txt", b"\xc3\xa9t\xc3\xa9\n", headers)
    assert conn.getresponse().read() and True
    conn.request("GET", "/files?path=/workspace/a%20b.txt", headers=headers)
    assert conn.getresponse().read() == "été\n".encode()
    conn.request("GET", "/files/list?path=/workspace", headers=headers)
    assert [e["name"] for e in json.loads(conn.getresponse().read())["entries"]] == ["a b.txt"]
    op = f"op-{uuid.uuid4().hex}"
    body = {"operation_id": op, "command": "for i in 1 2 3; do echo $i; done", "stream": True}
    conn.request("POST", "/exec", json.dumps(body), headers)
    frames = [json.loads(line) for line in conn.getresponse().read().splitlines()]
    assert [f["type"] for f in frames] == ["start", "stdout", "exit"] or len(frames) > 3
    assert frames[-1]["type"] == "exit"
    assert frames[-1]["result"]["termination"]["exit_code"] == 0
    conn.request("GET", f"/operations/{op}?wait=5", headers=headers)
    assert json.loads(conn.getresponse().read())["operation_id"] == op
    conn.close()
    assert sb.sh('python3 -c \'print("é".encode("idna"))\'')[0] == 0
    assert pty_roundtrip(ep.host, ep.port, token) == (b"pty-ok", 3)
    log = (sb.backend._dir(sb.id) / "agent.log").read_text()
    assert "late import" not in log
    assert "Traceback" not in log


def pty_roundtrip(
    host: str, port: int, token: str, cmd: str = "echo pty-ok; exit 3"
) -> tuple[bytes, int]:
    sock = socket.create_connection((host, port), timeout=20)
    sock.sendall(
        (
            f"POST /pty HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Connection: Upgrade\r\nUpgrade: hedgerow-pty/1\r\nContent-Length: 0\r\n\r\n"
        ).encode()
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(4096)
    assert buf.startswith(b"HTTP/1.1 101"), buf
    buf = buf.split(b"\r\n\r\n", 1)[1]
    init = json.dumps({"cmd": cmd, "rows": 24, "cols": 80}).encode()
    sock.sendall(struct.pack(">cI", b"I", len(init)) + init)
    output = b""
    while True:
        while len(buf) < 5 or len(buf) < 5 + struct.unpack(">cI", buf[:5])[1]:
            chunk = sock.recv(65536)
            assert chunk, "pty closed before its exit frame"
            buf += chunk
        kind, length = struct.unpack(">cI", buf[:5])
        payload, buf = buf[5 : 5 + length], buf[5 + length :]
        if kind == b"O":
            output += payload
        elif kind == b"X":
            sock.close()
            return output.strip(), int(json.loads(payload)["code"])
        elif kind == b"E":
            raise AssertionError(payload)


def all_gone(pids: list[tuple[int, int | None]]) -> bool:
    return not any(is_alive(pid, start) for pid, start in pids)


def test_it_ends_the_sandbox_when_its_agent_dies(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    for victim in ("agent_pid", "pid"):  # the agent, then the recorded pid (pid 1 inside)
        sb = sandbox_factory()
        m = meta(sb)
        pids = [
            (m["pid"], m["start_time"]),
            (m["bwrap_pid"], m["bwrap_start_time"]),
            (m["agent_pid"], proc_start_time(m["agent_pid"])),
        ]
        os.kill(m[victim], signal.SIGKILL)
        until(functools.partial(all_gone, pids), "the sandbox to end")
        assert sb.backend.endpoint(sb.id) is None
        assert sb.backend.network.netns_pids(sb.id) == []


def mount_points(pid: int | str) -> list[str]:
    return [line.split(" ")[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]


def test_it_starts_bwrap_where_no_other_sandbox_netns_is_mounted(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    first, second = sandbox_factory(), sandbox_factory()
    host = mount_points("self")
    first_ns = f"/run/netns/{first.backend.names.netns(first.id)}"
    assert first_ns in host  # the host's table has one mount per live sandbox
    # bwrap's outer process stays in the namespace it was started in: the launcher's
    bwrap_pid = meta(second)["bwrap_pid"]
    assert os.readlink(f"/proc/{bwrap_pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    launcher = mount_points(bwrap_pid)
    hidden = [p for p in launcher if p.startswith(("/run/netns", "/sys"))]
    assert hidden == [], hidden
    assert {"/", "/proc", "/dev"} <= set(launcher)
    # and a third sandbox's bwrap sees no more mounts than the second's did
    third = sandbox_factory()
    assert len(mount_points(meta(third)["bwrap_pid"])) == len(launcher)
    assert third.sh("echo ok") == (0, "ok\n", "")


_LAUNCHER_PROBE = """
import json, os, subprocess, sys
import zygote.daemon as z
root = sys.argv[1]
def mount(*args):
    subprocess.run(["mount", *args], check=True)
mount("--make-rprivate", "/")
mount("-t", "tmpfs", "none", root)
os.makedirs(root + "/hide")
os.makedirs(root + "/keep")
mount("-t", "tmpfs", "none", root + "/hide")
os.makedirs(root + "/hide/deep")
mount("-t", "tmpfs", "none", root + "/hide/deep")
mount("-t", "tmpfs", "none", root + "/hide/deep")  # stacked on the same point
mount("-t", "tmpfs", "none", root + "/keep")
fd = z.make_launcher_ns((root + "/hide",))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    z._setns(fd, z.CLONE_NEWNS, "launcher")
    os.write(w, json.dumps(z._mount_points()).encode())
    os._exit(0)
os.close(w)
seen = json.loads(os.read(r, 1 << 20))
os.waitpid(pid, 0)
print(json.dumps({"launcher": seen, "own": z._mount_points()}))
"""


def test_it_makes_a_launcher_namespace_without_the_hidden_mounts(tmp_path: Path) -> None:
    root = str(tmp_path / "m")
    os.makedirs(root)
    # in a throwaway mount namespace: the host's table is never touched
    out = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", _LAUNCHER_PROBE, root],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(PODAGENT.parent),
    ).stdout
    tables = json.loads(out)
    own, launcher = tables["own"], tables["launcher"]
    # the namespace that made it keeps all its mounts
    assert own.count(f"{root}/hide/deep") == 2 and f"{root}/hide" in own
    # the launcher: nothing at or below the hidden point, everything else
    assert [p for p in launcher if p.startswith(f"{root}/hide")] == []
    assert f"{root}/keep" in launcher and root in launcher
    # Compared below the test's own root only: the rest of the table is the host's,
    # which other runs on this machine change while the probe reads it.
    mine = [p for p in own if p.startswith(root)]
    assert sorted(p for p in launcher if p.startswith(root)) == sorted(
        p for p in mine if not p.startswith(f"{root}/hide")
    )
    assert len(mine) == 5  # root, keep, hide, and deep twice


def test_it_passes_agent_arguments_the_agent_reads_without_argparse() -> None:
    from podagent.__main__ import _parse_plain

    args = [*process.agent_args(8000), "--listening-fd", "5"]
    parsed = _parse_plain(args)
    assert parsed is not None, "an option the agent's plain reader does not know"
    assert parsed.listen == ("0.0.0.0", 8000) and parsed.unlink_token is True


def _hand_over(
    order: dict[str, Any], fds: list[int], cgroup_fds: dict[str, list[int]], answer: bytes
) -> tuple[int | BaseException, dict[str, Any] | None, list[int]]:
    """The worker's side (_start_agent_by_seed) in a thread, the seed's (_read_order)
    here, the seed answering ``answer`` (b"": it exits without one)."""
    worker, seed = socket.socketpair()
    result: list[int | BaseException] = []

    def work() -> None:
        try:
            result.append(
                zygote_daemon._start_agent_by_seed(
                    worker, order, 77, time.monotonic() + 10, fds, cgroup_fds
                )
            )
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    try:
        got, got_fds = zygote_daemon._read_order(seed)
        if answer:
            seed.sendall(answer)
        else:
            seed.close()
        thread.join(10)
        assert not thread.is_alive()
        return result[0], got, got_fds
    finally:
        worker.close()
        seed.close()


def test_the_seed_gets_the_agents_order_and_descriptors_whole(tmp_path: Path) -> None:
    """Issue 20: the agent is forked by a seed, a fork of the zygote that does nothing
    but take this order, so the worker's pages (request, bwrap, waits) never become the
    agent's. The order carries what the agent needs of the request, however large, and
    the descriptors in order, close-on-exec."""
    files = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT | O_CLOEXEC) for i in range(8)]
    big_env = {f"VAR{i}": "x" * 1000 for i in range(300)}  # ~300 KiB: several reads
    request = {
        "agent_args": ["--listen", "0.0.0.0:8000"],
        "caps": [],
        "env": big_env,
        "umask": 18,
        "workdir": "/workspace",
        "cgroups": ["/sys/fs/cgroup/x"],
        "bwrap_args": ["--not-for-the-agent"],
        "token": "secret-not-for-the-seed",
    }
    try:
        pid, order, got = _hand_over(
            request, files[:6], {"memory": [files[6], files[7]]}, b'{"ok": true, "agent_pid": 4242}'
        )
        assert pid == 4242
        assert order is not None
        assert order["env"] == big_env and order["pause"] == 77
        assert order["cgroups"] == ["/sys/fs/cgroup/x"]
        assert "bwrap_args" not in order and "token" not in order
        assert len(got) == 8
        assert [os.fstat(fd).st_ino for fd in got] == [os.fstat(fd).st_ino for fd in files]
        assert [got[i] for i in order["cgroup_fds"]["memory"]] == got[6:]
        assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in got)
        for fd in got:
            os.close(fd)

        failed, _, got = _hand_over(
            request, files[:6], {}, b'{"ok": false, "stage": "agent: setns(pid)", "error": "x"}'
        )
        for fd in got:
            os.close(fd)
        assert isinstance(failed, zygote_daemon.ZygoteError)
        assert failed.stage == "agent: setns(pid)"
        gone, _, got = _hand_over(request, files[:6], {}, b"")
        for fd in got:
            os.close(fd)
        assert isinstance(gone, zygote_daemon.ZygoteError)
        assert "seed exited before it started the agent" in str(gone)
    finally:
        for fd in files:
            os.close(fd)
    worker, seed = socket.socketpair()
    worker.close()
    assert zygote_daemon._read_order(seed) == (None, [])  # no spawn: nothing to start
    seed.close()


def test_it_keeps_sandboxes_running_when_the_zygote_dies_and_starts_a_new_one(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    before = sandbox_factory()
    answer = before.backend.zygote.ping()
    assert answer is not None
    old = int(answer["pid"])
    os.kill(old, signal.SIGKILL)
    until(lambda: not is_alive(old, None), "the zygote to die")
    assert before.sh("echo still here") == (0, "still here\n", "")
    after = sandbox_factory()  # the next provision starts a fresh zygote
    answer = after.backend.zygote.ping()
    assert answer is not None and int(answer["pid"]) != old
    assert after.sh("echo new") == (0, "new\n", "")
    assert before.sh("echo old") == (0, "old\n", "")
    assert meta(before)["launch"] == meta(after)["launch"] == "zygote"


def test_it_runs_the_zygote_with_a_clean_environment(
    sandbox_factory: Callable[..., Sandbox],
) -> None:
    sb = sandbox_factory()
    answer = sb.backend.zygote.ping()
    assert answer is not None
    environ = Path(f"/proc/{answer['pid']}/environ").read_bytes().split(b"\0")
    # agents are forks of it: nothing of the control plane's environment may be there
    assert sorted(e.split(b"=")[0] for e in environ if e) == [b"LANG", b"PATH"]
    assert answer["version"] == source_version(PODAGENT)
    assert zygote_daemon.source_version(str(PODAGENT)) == source_version(PODAGENT)


def test_it_runs_the_zygote_on_the_configured_interpreter_and_replaces_one_of_another(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox], tmp_path: Path
) -> None:
    """HEDGEROW_LOCAL_ZYGOTE_PYTHON (issue 20: an interpreter with immortal objects
    copies fewer of the zygote's pages per agent): the zygote and its agents run the
    configured interpreter, a running zygote of another is replaced (its sandboxes keep
    running), and a path that is no interpreter is refused typed at once."""
    default = os.path.realpath(sys.executable)
    system = os.path.realpath("/usr/bin/python3")  # the exec launch's default, too
    assert system != default, "needs a second interpreter: /usr/bin/python3 is the venv's"
    before = sandbox_factory()
    answer = backend.zygote.ping()
    assert answer is not None and answer["exe"] == default

    other = LocalBackend(replace(backend.config, zygote_python="/usr/bin/python3"))
    spec = new_spec()
    endpoint = other.provision(spec)
    try:
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        sb = Sandbox(other, spec, endpoint)
        replaced = other.zygote.ping()
        assert replaced is not None and replaced["exe"] == system
        assert int(replaced["pid"]) != int(answer["pid"])
        assert os.readlink(f"/proc/{meta(sb)['agent_pid']}/exe") == system
        assert sb.sh("echo on the other") == (0, "on the other\n", "")
        assert before.sh("echo still here") == (0, "still here\n", "")
    finally:
        other.destroy(spec.sandbox_id)
    backend.zygote.ensure()  # and back: the fixture's backend wants its own
    back = backend.zygote.ping()
    assert back is not None and back["exe"] == default

    with pytest.raises(BackendError, match="not an executable file"):
        LocalBackend(replace(backend.config, zygote_python=str(tmp_path / "no-python")))


def test_it_reports_a_failed_bwrap_typed_with_its_stderr_and_leaves_nothing(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = process.bwrap_argv

    def broken(**kwargs: Any) -> list[str]:
        return ["bwrap", "--no-such-option", *real(**kwargs)[1:]]

    monkeypatch.setattr(process, "bwrap_argv", broken)
    spec = new_spec()
    with pytest.raises(BackendError, match="bwrap exited before the sandbox was ready") as err:
        backend.provision(spec)
    assert "no-such-option" in str(err.value)  # bwrap's own complaint, from agent.log
    assert [i for i in backend.inventory() if i.sandbox_id == spec.sandbox_id] == []
    assert backend.zygote.ping() is not None  # a failed launch does not take it down


def test_it_gives_up_typed_when_the_sandbox_never_becomes_ready(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = process.bwrap_argv

    def never_ready(**kwargs: Any) -> list[str]:
        argv = real(**kwargs)
        assert argv[-3:] == ["/opt/hedgerow/pause", "3", "4"]
        return [*argv[:-3], "/usr/bin/sleep", "600"]  # a payload that never says ready

    monkeypatch.setattr(process, "bwrap_argv", never_ready)
    monkeypatch.setattr(backend, "agent_start_timeout", 1.0)
    spec = new_spec()
    with pytest.raises(BackendError, match="did not become ready in time"):
        backend.provision(spec)
    assert [i for i in backend.inventory() if i.sandbox_id == spec.sandbox_id] == []


def test_it_runs_agents_in_an_image_without_python_or_bundle(
    backend: LocalBackend, tmp_path: Path
) -> None:
    from .test_agent_bundle import BUSYBOX, busybox_rootfs_tarball

    if BUSYBOX is None:
        pytest.skip("needs busybox")
    backend.import_image("nopython", busybox_rootfs_tarball(tmp_path))
    spec = new_spec(image="nopython")
    endpoint = backend.provision(spec)
    try:
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        sb = Sandbox(backend, spec, endpoint)
        assert sb.sh("echo hi from $(busybox | head -1 | cut -d' ' -f1)")[:2] == (
            0,
            "hi from BusyBox\n",
        )
        assert sb.sh("ls /usr/bin/python3 /usr/local/bin/python3 2>&1; echo rc=$?")[1].endswith(
            "rc=1\n"
        )
    finally:
        backend.destroy(spec.sandbox_id)


def test_it_stops_the_zygote_with_the_instance(tmp_path: Path) -> None:
    b = LocalBackend(make_config(tmp_path, f"z{os.getpid()}", "netns"))
    try:
        spec = new_spec()
        wait_healthy(b.provision(spec), spec.agent_token, timeout=20)
        answer = b.zygote.ping()
        assert answer is not None
        pid = int(answer["pid"])
    finally:
        b.teardown_instance()
    until(lambda: not is_alive(pid, None), "the zygote to exit")
    assert not b.zygote.socket_path.exists()


def test_it_makes_a_late_import_fail_loudly(capfd: pytest.CaptureFixture[str]) -> None:
    guard = zygote_daemon._LateImportGuard()
    with pytest.raises(ModuleNotFoundError, match="late import of 'tomllib'"):
        guard.find_spec("tomllib")
    assert "late import of 'tomllib'" in capfd.readouterr().err
    with pytest.raises(ModuleNotFoundError):
        guard.find_spec("msvcrt")  # absent on Linux anyway: no noise
    assert capfd.readouterr().err == ""


def test_it_falls_back_to_exec_when_gcc_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_which = shutil.which

    def which(name: str, mode: int = os.F_OK | os.X_OK, path: str | None = None) -> str | None:
        return None if name == "gcc" else real_which(name, mode, path)

    monkeypatch.setattr(shutil, "which", which)
    config = make_config(tmp_path, f"g{os.getpid()}", "netns")
    # pause is built under the machine-wide runtime dir (claims_dir's parent): a fresh one
    config = replace(config, claims_dir=tmp_path / "run" / "subnets")  # nothing built there
    with caplog.at_level(logging.WARNING):
        assert LocalBackend(config).agent_launch == "exec"
    assert "agents start by exec: gcc is not installed" in caplog.text
    with pytest.raises(ZygoteUnavailable, match="gcc is not installed"):
        _ = LocalBackend(replace(config, agent_launch="zygote")).agent_launch


def test_it_answers_once_the_agent_listens_so_one_probe_is_enough(
    backend: LocalBackend,
) -> None:
    # No retry: the zygote replies only after the agent's socket listens, so the very
    # first connection is accepted (before, it was refused and polled again after a
    # sleep, ~2.4 probes per sandbox).
    spec = new_spec()
    endpoint = backend.provision(spec)
    try:
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=10)
        conn.request("GET", "/health", headers={"Authorization": f"Bearer {spec.agent_token}"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        backend.destroy(spec.sandbox_id)


def test_it_reports_an_agent_that_exits_before_listening_typed_and_leaves_nothing(
    backend: LocalBackend,
) -> None:
    spec = new_spec(agent_token="")  # the agent refuses to start without a token
    with pytest.raises(BackendError, match="exited before it listened"):
        backend.provision(spec)
    assert [i for i in backend.inventory() if i.sandbox_id == spec.sandbox_id] == []
    assert backend.zygote.ping() is not None
