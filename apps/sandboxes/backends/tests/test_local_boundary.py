"""The sandbox boundary, attacked from inside real sandboxes (both launch modes): a
command is root only of its own user namespace (unprivileged host ids), under the
container-default seccomp filter, with /proc's kernel knobs read-only and its
host-describing files masked, and sees no host path (docs/security.md)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local.idmap import uid_base
from podagent.userns import RANGE

from .conftest import REPO, Sandbox, needs_root, new_spec

pytestmark = needs_root

# The writable sysctls of the review: each a host-wide kernel knob (or, for pid_max on
# kernels >= 6.14, one the sandbox's own pid namespace would carry).
SYSCTLS = {
    "kernel/core_pattern": "|/workspace/pwn.sh",
    "vm/panic_on_oom": "2",
    "kernel/panic": "7",
    "kernel/pid_max": "4242",
    "fs/file-max": "4242",
    "kernel/randomize_va_space": "0",
    "kernel/perf_event_paranoid": "-1",
}

Factory = Callable[..., Sandbox]


@pytest.fixture(params=["zygote", "exec"])
def make_sandbox(request: pytest.FixtureRequest, backend: LocalBackend) -> Iterator[Factory]:
    """Sandboxes of the session's instance, started by the zygote or by exec."""
    mode = request.param
    b = (
        backend
        if mode == "zygote"
        else LocalBackend(
            replace(backend.config, agent_launch="exec", allow_unprotected_exec_launch=True)
        )
    )
    made: list[str] = []

    def make(**overrides: object) -> Sandbox:
        spec = new_spec(**overrides)
        made.append(spec.sandbox_id)
        endpoint = b.provision(spec)
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        sb = Sandbox(b, spec, endpoint)
        assert meta(sb)["launch"] == mode
        return sb

    yield make
    for sid in made:
        b.destroy(sid)


def meta(sb: Sandbox) -> dict[str, object]:
    data = sb.backend._meta(sb.id)
    assert data is not None
    return data


def workspace(sb: Sandbox) -> Path:
    return sb.backend._data_dirs(sb.id)[0]


def host_sysctl(name: str) -> str:
    return Path("/proc/sys", name).read_text()


def test_no_kernel_knob_can_be_written_from_inside(make_sandbox: Factory) -> None:
    sb = make_sandbox()
    before = {name: host_sysctl(name) for name in SYSCTLS}
    for name, value in SYSCTLS.items():
        code, _, err = sb.sh(f"printf '%s\\n' '{value}' > /proc/sys/{name}")
        assert code != 0, (name, err)
        assert "Read-only file system" in err, (name, err)
    # the network namespace is the host's (initial user namespace): no CAP_NET_ADMIN
    code, _, err = sb.sh("echo 1 > /proc/sys/net/ipv4/ip_forward")
    assert code != 0, err
    for command in ("ip link set eth0 down", "ip addr add 10.9.9.9/32 dev eth0"):
        code, _, err = sb.sh(command)
        assert code != 0 and "Operation not permitted" in err, (command, err)
    code, _, err = sb.sh("nft add table inet hedgerow_pwn")
    assert code != 0, err
    assert sb.sh("ip -o link show eth0")[1].count("state UP") == 1
    assert {name: host_sysctl(name) for name in SYSCTLS} == before


def test_a_crash_runs_nothing_on_the_host(make_sandbox: Factory) -> None:
    """The review's route to host root: core_pattern piped to a script in /workspace,
    then a crash. core_pattern cannot be set, so the crash runs nothing."""
    sb = make_sandbox()
    before = host_sysctl("kernel/core_pattern")
    script = workspace(sb) / "pwn.sh"
    marker = workspace(sb) / "pwned"
    code, _, err = sb.sh(
        "printf '#!/bin/sh\\ntouch %s\\n' "
        f"{marker} > /workspace/pwn.sh && chmod 755 /workspace/pwn.sh && "
        f"echo '|{script}' > /proc/sys/kernel/core_pattern"
    )
    assert code != 0 and "Read-only file system" in err, err
    code, _, _ = sb.sh("ulimit -c unlimited; sh -c 'kill -SEGV $$'")
    assert code != 0  # it crashed
    assert host_sysctl("kernel/core_pattern") == before
    assert not marker.exists()
    assert not (workspace(sb) / "..").joinpath("pwned").exists()


def test_sandbox_root_is_an_unprivileged_host_id_of_its_own(make_sandbox: Factory) -> None:
    a, b = make_sandbox(), make_sandbox()
    for sb in (a, b):
        base = meta(sb)["uid_base"]
        assert base == uid_base(str(meta(sb)["ip"]))
        assert isinstance(base, int) and RANGE <= base <= (1 << 32) - 2 * RANGE
        assert sb.sh("id -u; id -g")[1] == "0\n0\n"  # root inside
        assert sb.sh("cat /proc/self/uid_map")[1].split() == ["0", str(base), str(RANGE)]
        code, _, err = sb.sh("touch /workspace/mine && mkdir /workspace/d")
        assert code == 0, err
        for name in ("mine", "d"):
            st = (workspace(sb) / name).stat()
            assert (st.st_uid, st.st_gid) == (base, base)
    assert meta(a)["uid_base"] != meta(b)["uid_base"]


def test_a_setuid_file_written_inside_gives_no_host_user_root(make_sandbox: Factory) -> None:
    sb = make_sandbox()
    code, _, err = sb.sh(
        "cp /bin/sh /workspace/x && chmod 4755 /workspace/x && ls -ln /workspace/x"
    )
    assert code == 0, err
    host_file = workspace(sb) / "x"
    st = host_file.stat()
    base = meta(sb)["uid_base"]
    assert st.st_uid == base != 0 and st.st_mode & stat.S_ISUID
    # Run it as host `nobody`, from a copy with the same owner and mode in a directory
    # nobody can reach (the sandbox's data is under root's 0700 dirs).
    reachable = Path(tempfile.mkdtemp(prefix="hedgerow-suid-", dir="/tmp"))
    try:
        os.chmod(reachable, 0o755)
        copy = reachable / "x"
        shutil.copyfile(host_file, copy)
        os.chown(copy, st.st_uid, st.st_gid)
        os.chmod(copy, stat.S_IMODE(st.st_mode))  # after chown, which clears S_ISUID
        assert copy.stat().st_mode == st.st_mode and copy.stat().st_uid == st.st_uid
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        out = subprocess.run(
            [*as_nobody, str(copy), "-p", "-c", "id -u; id -ru"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    finally:
        shutil.rmtree(reachable)
    assert out == [str(base), "65534"], out  # euid: the sandbox's unprivileged id, not 0
    # and inside, every writable mount is nosuid (and nodev but for device files)
    lines = sb.sh("cat /proc/self/mountinfo")[1].splitlines()
    writable = {}
    for line in lines:
        fields = line.split()
        point, options = fields[4], fields[5].split(",")
        if "rw" in options:
            writable[point] = options
    for point in ("/workspace", "/tmp"):
        assert point in writable
    for point, options in writable.items():
        assert "nosuid" in options, (point, options)
        # device files need dev: only bwrap's /dev binds and devpts (mknod needs
        # CAP_MKNOD of the initial user namespace anyway)
        if not (point == "/dev/pts" or (point.startswith("/dev/") and point.count("/") == 2)):
            assert "nodev" in options, (point, options)


SECCOMP_PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"unshare": 272, "mount": 165, "keyctl": 250, "add_key": 248, "request_key": 249,
      "bpf": 321, "kexec_load": 246, "perf_event_open": 298, "setns": 308,
      "clone3": 435, "userfaultfd": 323, "pivot_root": 155, "open_by_handle_at": 304,
      "init_module": 175, "io_uring_setup": 425, "fsopen": 430}
args = {"unshare": (0x10000000,), "mount": (b"none", b"/tmp", b"tmpfs", 0, None),
        "keyctl": (0, -4, 0, 0, 0), "add_key": (b"user", b"k", b"v", 1, -4),
        "request_key": (b"user", b"k", None, -4), "bpf": (0, None, 0),
        "kexec_load": (0, 0, None, 0), "perf_event_open": (None, 0, -1, -1, 0),
        "setns": (-1, 0), "clone3": (None, 0), "userfaultfd": (0,),
        "pivot_root": (b"/", b"/"), "open_by_handle_at": (-1, None, 0),
        "init_module": (None, 0, b""), "io_uring_setup": (1, None), "fsopen": (b"tmpfs", 0)}
for name, nr in NR.items():
    ctypes.set_errno(0)
    rc = libc.syscall(nr, *args[name])
    print(name, rc, errno.errorcode.get(ctypes.get_errno(), "0"))
"""

EXPECTED_ERRNO = {"clone3": "ENOSYS"}


def test_seccomp_refuses_the_dangerous_calls_but_not_ordinary_work(
    make_sandbox: Factory,
) -> None:
    sb = make_sandbox()
    out = sb.exec(["python3", "-c", SECCOMP_PROBE])["stdout"]["head"]
    results = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert len(results) == 16, out
    for name, (rc, err) in results.items():
        assert (rc, err) == ("-1", EXPECTED_ERRNO.get(name, "EPERM")), (name, rc, err)
    for tool in ("unshare -U true", "unshare -r true"):
        code, _, err = sb.sh(tool)
        assert code != 0 and "Operation not permitted" in err, (tool, err)
    assert sb.sh("mount -t tmpfs none /tmp")[0] != 0
    status = sb.sh("grep -h '^Seccomp:' /proc/self/status /proc/$PPID/status /proc/1/status")
    assert status[1].split() == ["Seccomp:", "2"] * 3, status  # command, agent, pid 1
    # ordinary workloads still work under the filter: threads, subprocesses (clone3 →
    # clone), git, bash job control, a venv
    threads = (
        "import threading as t; x = t.Thread(target=print, args=('thread',)); x.start(); x.join()"
    )
    assert sb.exec(["python3", "-c", threads])["stdout"]["head"] == "thread\n"
    spawn = (
        "import subprocess; print(subprocess.run(['echo', 'child'], capture_output=True).stdout)"
    )
    assert sb.exec(["python3", "-c", spawn])["stdout"]["head"] == "b'child\\n'\n"
    code, out, err = sb.sh(
        "cd /workspace && git init -q r && cd r && echo a > f && git add f && "
        "git -c user.email=a@b -c user.name=n commit -qm m && git log --oneline | wc -l"
    )
    assert (code, out) == (0, "1\n"), err
    code, out, err = sb.sh("bash -c 'set -m; sleep 0.1 & jobs >/tmp/j; wait; wc -l </tmp/j'")
    assert (code, out) == (0, "1\n"), err
    code, out, err = sb.sh(
        "python3 -m venv /tmp/v --without-pip && /tmp/v/bin/python -c 'print(1)'"
    )
    assert (code, out) == (0, "1\n"), err


def test_proc_is_masked_and_read_only_and_there_is_no_sys(make_sandbox: Factory) -> None:
    sb = make_sandbox()
    mounts = {}
    for line in sb.sh("cat /proc/self/mountinfo")[1].splitlines():
        fields = line.split()
        mounts[fields[4]] = fields[5].split(",")
    for name in ("sys", "sysrq-trigger", "irq", "bus"):
        if Path("/proc", name).exists():
            assert "ro" in mounts[f"/proc/{name}"], (name, mounts.get(f"/proc/{name}"))
    code, _, err = sb.sh("echo h > /proc/sysrq-trigger")
    assert code != 0, err
    for name in ("kcore", "keys", "key-users", "timer_list", "sched_debug", "kallsyms"):
        if Path("/proc", name).exists():
            assert f"/proc/{name}" in mounts, name
            code, out, _ = sb.sh(f"cat /proc/{name}")
            assert out == "", (name, out[:200])
    for name in ("acpi", "scsi"):
        if Path("/proc", name).is_dir():
            assert "ro" in mounts[f"/proc/{name}"]
            assert sb.sh(f"ls -A /proc/{name}")[1] == ""
    assert sb.sh("test -e /sys; echo $?")[1] == "1\n"


def test_no_host_path_is_visible_inside(make_sandbox: Factory) -> None:
    sb = make_sandbox()
    needles = {
        str(sb.backend.config.state_dir),
        str(REPO),
        str(REPO.parent) + "/",
        os.path.realpath(sys.executable),
        sys.prefix,
    }
    seen = sb.sh(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; "
        "tr '\\0' ' ' <$p/environ 2>/dev/null; echo; done"
    )[1]
    pid1 = sb.sh("tr '\\0' ' ' </proc/1/cmdline")[1].split()
    if meta(sb)["launch"] == "zygote":  # pause is pid 1 (bwrap --as-pid-1)
        assert pid1 == ["/opt/hedgerow/pause", "3", "4"], pid1
    else:
        assert pid1[1] == "--args", pid1
    assert not {"--bind", "--ro-bind", "--setenv", "--seccomp"} & set(pid1), pid1  # by --args
    for needle in needles:
        assert needle not in seen, (needle, seen)
    mountinfo = sb.sh("cat /proc/self/mountinfo")[1].splitlines()
    assert len(mountinfo) > 10
    for line in mountinfo:  # /workspace and /tmp included: they come from the storage
        for needle in needles:
            assert needle not in line, (needle, line)


KEYRING_PROBE = r"""
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "add":
    rc = libc.syscall(248, b"user", sys.argv[2].encode(), b"secret-of-a", 11, -4)
else:
    rc = libc.syscall(250, 0, -4, 0, 0, 0)  # KEYCTL_GET_KEYRING_ID of the user keyring
print(rc, errno.errorcode.get(ctypes.get_errno(), "0"))
"""


def test_no_keyring_is_shared_between_tenants(make_sandbox: Factory) -> None:
    a = make_sandbox(tenant_id="tenant-a")
    b = make_sandbox(tenant_id="tenant-b")
    name = f"hedgerow-cross-tenant-{a.id}"
    added = a.exec(["python3", "-c", KEYRING_PROBE, "add", name])["stdout"]["head"]
    try:
        assert added == "-1 EPERM\n"
        assert b.exec(["python3", "-c", KEYRING_PROBE, "get"])["stdout"]["head"] == "-1 EPERM\n"
        assert name not in b.sh("cat /proc/keys /proc/key-users")[1]
        assert name not in Path("/proc/keys").read_text()  # nor did it reach the host's
    finally:
        _invalidate_host_keys(name)  # code that lets it through puts it in uid 0's keyring


def _invalidate_host_keys(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for line in Path("/proc/keys").read_text().splitlines():
        if f" {name}:" in line:
            libc.syscall(250, 21, int(line.split()[0], 16), 0, 0, 0)  # KEYCTL_INVALIDATE


def test_the_token_is_never_a_host_file(make_sandbox: Factory) -> None:
    sb = make_sandbox()
    state = sb.backend._dir(sb.id)
    for path in state.rglob("*"):
        if path.is_file():
            assert sb.spec.agent_token.encode() not in path.read_bytes(), path
    assert not (state / "secret").exists()  # no host copy was ever written
    assert sb.sh("ls -A /run/hedgerow")[1] == ""  # the agent consumed its copy
    assert sb.spec.agent_token not in json.dumps(meta(sb))


@pytest.mark.parametrize("make_sandbox", ["zygote"], indirect=True)  # pause is the zygote's
def test_commands_cannot_open_pauses_descriptors(make_sandbox: Factory) -> None:
    """pause runs as sandbox root: were it dumpable, a command could open a write end
    of its hold pipe through /proc (keeping pause from seeing the agent die) or its
    stdout (the host-side agent.log)."""
    sb = make_sandbox()
    out = sb.sh(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline | grep -q '^/opt/hedgerow/pause ' "
        "&& echo ${p#/proc/}; done"
    )[1]
    pids = out.split()
    assert len(pids) == 1, out
    # (the fd directory itself may be listed: it belongs to the namespace's root)
    link = sb.sh(f"readlink -v /proc/{pids[0]}/fd/1 2>&1; echo rc=$?")[1]
    assert "Permission denied" in link and link.endswith("rc=1\n"), link
    hold = sb.sh(f"(exec 9>/proc/{pids[0]}/fd/4) 2>&1; echo rc=$?")[1]
    assert "Permission denied" in hold and hold.endswith("rc=1\n"), hold
    assert sb.sh(f"grep -c . /proc/{pids[0]}/status")[0] == 0  # still visible, just closed
