"""Launching the pod agent: the bwrap command line and the detached start.

Two launches (docs/local-backend.md). With the zygote (``zygote.py``, the default),
bwrap's payload is the static pause binary and the agent is forked in by the zygote;
this module only builds that bwrap command line. With exec launch the agent is bwrap's
payload, started by the chain below.

Exec chain (one pid all along, recorded in meta.json as the supervising pid):
``setsid → sh (join cgroups) → ip netns exec NS → bwrap``. The cgroups are joined
before ``ip netns exec`` because it remounts /sys, hiding /sys/fs/cgroup.
The chain is started from a throwaway ``sh`` that exits at once, so the sandbox
is reparented to init: the Celery worker that provisioned it may die freely.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from apps.sandboxes.backends.base import BackendError

from ._sys import SYSTEM_PATH, is_alive, proc_start_time
from .config import AGENT_MOUNT, BUNDLE_MOUNT, SECRET_MOUNT
from .zygote import (
    EXEC_HELPER_MOUNT,
    HOLD_FD,
    INFO_FD,
    PAUSE_MOUNT,
    READY_FD,
    exec_helper_path,
)

_LAUNCH = 'log=$1; shift; setsid "$@" </dev/null >>"$log" 2>&1 & echo $!'
_JOIN_CGROUPS = (
    'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 97; shift; done; shift; exec "$@"'
)
AGENT_ENV_RESTORE = json.dumps({"PYTHONPATH": None})
# What an exec-started agent's commands see (bwrap's --setenv, minus what the agent
# restores): a zygote-started agent gets exactly this as its environment.
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}
# `python` value meaning "the image has no python3: run the agent from the bundle"
BUNDLED_PYTHON = "<agent-bundle>"
_HOST_ETC = (
    "passwd",
    "group",
    "hosts",
    "resolv.conf",
    "nsswitch.conf",
    "ld.so.cache",
    "ld.so.conf",
    "localtime",
    "alternatives",
    "ssl",
    "ca-certificates",
    "mime.types",
)
_ROOTFS_SKIP = {"proc", "dev", "sys", "tmp", "workspace", "run", "opt"}
# /proc as the OCI runtime spec's defaults (runc's readonlyPaths and maskedPaths) leave
# it: the kernel's knobs read-only (bwrap covers /proc/sys only when its own access()
# says writable, which it never does in the user namespace) and what describes the
# host's kernel, keys or hardware masked. Read-only binds come from the host's /proc
# (bwrap's sources are outside paths): the same sysctl files, the values each reader's
# own namespaces select. A masked file is /dev/null bound nodev (opening it fails), a
# masked directory an empty read-only tmpfs. Only what this kernel has.
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
PROC_MASKED_FILES = (
    "kcore",
    "keys",
    "key-users",
    "timer_list",
    "timer_stats",
    "sched_debug",
    "latency_stats",
    "kallsyms",
)
PROC_MASKED_DIRS = ("acpi", "scsi")
# What root inside an OCI image sandbox may do, as in a container: Docker's default
# capability set, in the sandbox's user namespace only (docs/security.md). Host and
# legacy-image sandboxes keep none.
IMAGE_CAPABILITIES = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_RAW": 13,
    "CAP_SYS_CHROOT": 18,
    "CAP_MKNOD": 27,
    "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
}


def host_base_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
        target = Path("/") / link
        if target.is_symlink():
            args += ["--symlink", os.readlink(target), f"/{link}"]
        elif target.is_dir():
            args += ["--ro-bind", str(target), f"/{link}"]
    for name in _HOST_ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


@functools.cache
def proc_mask_args() -> tuple[str, ...]:
    args: list[str] = []
    for name in PROC_READONLY:
        if os.path.lexists(f"/proc/{name}"):
            args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in PROC_MASKED_FILES:
        if os.path.lexists(f"/proc/{name}"):
            args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    for name in PROC_MASKED_DIRS:
        if os.path.isdir(f"/proc/{name}"):
            args += ["--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    return tuple(args)


def rootfs_base_args(rootfs: Path) -> list[str]:
    args: list[str] = []
    for entry in sorted(rootfs.iterdir()):
        dest = f"/{entry.name}"
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry), dest]
        elif entry.name == "opt" and entry.is_dir():
            # /opt/hedgerow must stay mountable: bind /opt's children instead
            for child in sorted(entry.iterdir()):
                if child.name != "hedgerow":
                    args += ["--ro-bind", str(child), f"/opt/{child.name}"]
        elif entry.is_dir() and entry.name not in _ROOTFS_SKIP:
            args += ["--ro-bind", str(entry), dest]
    return args


@contextlib.contextmanager
def cgroup_fds(files: dict[str, list[str]]) -> Iterator[dict[str, list[int]]]:
    """Exec launch: the cgroup files the agent uses (podagent/limits.py), opened here
    (as root, seeing the host's /sys) for the launch to pass down: they are inherited
    through setsid, ip netns exec and bwrap by the agent, on the same numbers."""
    opened: dict[str, list[int]] = {}
    try:
        for name, paths in sorted(files.items()):
            flags = (os.O_WRONLY if name.endswith("_tasks") else os.O_RDONLY) | os.O_CLOEXEC
            opened[name] = []
            for path in paths:
                opened[name].append(os.open(path, flags))
        yield opened
    finally:
        for fds in opened.values():
            for fd in fds:
                os.close(fd)


def find_exec_agent(pid: int, start_time: int, timeout: float) -> dict[str, int]:
    """An exec-started sandbox's agent: bwrap (``pid``) → its pid-namespace init → the
    init's first child. Recorded so the agent itself is watched (an orphan keeps the
    init alive after the agent died). {} when it cannot be found in time (the sandbox
    is then watched by ``pid`` alone, as before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and is_alive(pid, start_time):
        init = _children(pid)
        agent = _children(init[0]) if init else []
        if agent:
            agent_start = proc_start_time(agent[0])
            if agent_start is not None:
                return {"agent_pid": agent[0], "agent_start_time": agent_start}
        time.sleep(0.005)
    return {}


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def agent_args(
    port: int,
    workdir: str = "/workspace",
    user: tuple[int, int] | None = None,
    exec_helper: str | None = None,
) -> list[str]:
    # an image's User: commands run as these ids, the agent stays the sandbox's root
    identity = ["--user", f"{user[0]}:{user[1]}"] if user is not None else []
    # zygote launch: commands start through the exec helper (exec_helper.c), as other
    # real uids than the agent's
    helper = ["--exec-helper", exec_helper] if exec_helper is not None else []
    return [
        *identity,
        *helper,
        "--listen",
        f"0.0.0.0:{port}",
        "--token-file",
        f"{SECRET_MOUNT}/token",
        "--unlink-token",
        "--workdir",
        workdir,
        # JSON request lines (with the control plane's request id) go to the agent's
        # stdout, which the launcher appends to the host-side agent.log: traceable
        # from the host, and no log file the sandbox's own commands could rewrite.
        "--log-file",
        "/dev/stdout",
    ]


def _agent_command(python: str, port: int, workdir: str, user: tuple[int, int] | None) -> list[str]:
    args = agent_args(port, workdir, user)
    if python != BUNDLED_PYTHON:
        return [python, "-m", "podagent", *args]
    # the bundled loader runs the bundled interpreter, isolated (-I): nothing of the
    # image's libc or Python is used, and no PYTHONHOME/LD_LIBRARY_PATH is set
    lib = f"{BUNDLE_MOUNT}/lib"
    launcher = [f"{lib}/ld.so", "--library-path", lib, f"{BUNDLE_MOUNT}/bin/python3", "-I"]
    return [*launcher, "-m", "hedgerow_launcher", "run", "--", *args]


def bwrap_argv(
    *,
    base_args: Sequence[str],
    workspace: Path,
    tmp: Path,
    token_fd: int,
    podagent_dir: Path,
    python: str,
    port: int,
    seccomp_fd: int,
    agent_bundle: Path | None = None,
    pause: Path | None = None,
    cgroup_fds: dict[str, list[int]] | None = None,
    root: Path | None = None,
    env: dict[str, str] | None = None,
    workdir: str = "/workspace",
    caps: Sequence[str] = (),
    user: tuple[int, int] | None = None,
) -> list[str]:
    """bwrap's command line: options, ``--``, payload (``split`` separates them: the
    options go by ``--args``). With ``pause`` (zygote launch) the payload is the static
    pause binary and the agent is forked in later by the zygote: no agent mount or
    environment, and no --die-with-parent (bwrap's parent, a zygote handler, exits at
    once; the sandbox lives as long as the agent holds pause's hold pipe).
    ``seccomp_fd``: where bwrap finds the seccomp program (podagent/seccomp.py);
    ``token_fd``: the agent's token, copied into a tmpfs at /run/hedgerow (never a
    host file the sandbox binds: its path would show in mountinfo).
    ``root``: an OCI image's writable overlay (images/overlay.py), bound as ``/``
    instead of a read-only tmpfs holding ``base_args``; ``env``: what commands see
    (SANDBOX_ENV by default); ``workdir``: their default directory; ``caps``: what
    exec launch's agent (and so root's commands) keeps (the zygote's agent gets them
    from its request); ``user``: the ids the agent runs commands as."""
    seccomp = ["--seccomp", str(seccomp_fd)]
    layout = _Layout(base_args, root, SANDBOX_ENV if env is None else env)
    if pause is not None:
        # pause is the pid namespace's init (--as-pid-1): no command can signal it. Its
        # directory is searchable by every uid (an image User's commands start through
        # the exec helper beside it); bwrap would make it 0700 on an image's root.
        zygote_args = [
            "--as-pid-1",
            *("--perms", "0755", "--dir", str(Path(PAUSE_MOUNT).parent)),
            *("--ro-bind", str(pause), PAUSE_MOUNT, "--info-fd", str(INFO_FD)),
            *("--ro-bind", str(exec_helper_path(pause.parent)), EXEC_HELPER_MOUNT),
        ]
        payload = [PAUSE_MOUNT, str(READY_FD), str(HOLD_FD)]
        sandbox = _sandbox_args(layout, workspace, tmp, token_fd, seccomp, zygote_args)
        return ["bwrap", *sandbox, *payload]
    bundled = python == BUNDLED_PYTHON
    if bundled and agent_bundle is None:
        raise BackendError("no agent bundle configured for an image without python3")
    agent_env = [
        *seccomp,
        "--setenv",
        "PYTHONPATH",
        str(Path(AGENT_MOUNT).parent),
        "--setenv",
        "HEDGEROW_AGENT_ENV_RESTORE",
        AGENT_ENV_RESTORE,
    ]
    agent_mount = ["--ro-bind", str(podagent_dir), AGENT_MOUNT]
    if bundled:
        agent_env = seccomp  # the launcher leaves the environment as given
        agent_mount = ["--ro-bind", str(agent_bundle), BUNDLE_MOUNT]
    limits_args = ["--cgroup-fds", format_fds(cgroup_fds)] if cgroup_fds else []
    for cap in caps:
        agent_env = [*agent_env, "--cap-add", cap]
    return [
        "bwrap",
        "--die-with-parent",
        *_sandbox_args(layout, workspace, tmp, token_fd, agent_env, agent_mount),
        *_agent_command(python, port, workdir, user),
        *limits_args,
    ]


class _Layout:
    """The sandbox's root: a read-only tmpfs holding ``base_args`` (host, legacy
    images) or an OCI image's writable overlay root, and the commands' environment."""

    def __init__(self, base_args: Sequence[str], root: Path | None, env: dict[str, str]) -> None:
        self.base_args, self.root, self.env = list(base_args), root, env

    def root_args(self) -> list[str]:
        if self.root is None:
            return ["--tmpfs", "/", *self.base_args]
        # bwrap's --bind is always nosuid; the overlay itself is nodev
        return ["--bind", str(self.root), "/", *self.base_args]

    def seal_args(self) -> list[str]:
        return ["--remount-ro", "/"] if self.root is None else []


def _sandbox_args(
    layout: _Layout,
    workspace: Path,
    tmp: Path,
    token_fd: int,
    agent_env: Sequence[str],
    agent_mount: Sequence[str],
) -> list[str]:
    return [
        "--new-session",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
        "--clearenv",
        *(arg for key, value in layout.env.items() for arg in ("--setenv", key, value)),
        *agent_env,
        *layout.root_args(),
        "--proc",
        "/proc",
        *proc_mask_args(),
        "--dev",
        "/dev",
        "--bind",
        str(workspace),
        "/workspace",
        "--bind",
        str(tmp),
        "/tmp",
        *agent_mount,
        *("--perms", "0700", "--tmpfs", SECRET_MOUNT),
        *("--perms", "0600", "--file", str(token_fd), f"{SECRET_MOUNT}/token"),
        *layout.seal_args(),
        "--chdir",
        "/workspace",
        "--",
    ]


def format_fds(fds: dict[str, list[int]]) -> str:
    """``--cgroup-fds``'s value (podagent.limits.parse_fds reads it)."""
    return ",".join(f"{name}={':'.join(map(str, v))}" for name, v in sorted(fds.items()))


def split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``bwrap_argv``'s options (without the program) and payload."""
    end = list(argv).index("--")
    return list(argv[1:end]), list(argv[end + 1 :])


def data_memfd(name: str, data: bytes) -> int:
    """An inheritable fd (offset 0) holding ``data``: for bwrap's --args/--file."""
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def args_memfd(args: Sequence[str]) -> int:
    """An inheritable fd (offset 0) holding ``args`` NUL-separated: bwrap's --args."""
    return data_memfd("bwrap-args", b"".join(arg.encode() + b"\0" for arg in args))


def publish_podagent(podagent_dir: Path, runtime_dir: Path, version: str) -> Path:
    """A copy of the agent's sources under ``runtime_dir`` (exec launch binds it): a
    bind's source path shows in the sandbox's mountinfo, and the repository's path
    must not (the copy's is ``<runtime_dir>/agent-<version>/podagent``)."""
    target = runtime_dir / f"agent-{version}" / "podagent"
    if target.is_dir():
        return target
    staging = runtime_dir / f".agent-{version}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "podagent").mkdir(parents=True)
    try:
        for source in podagent_dir.glob("*.py"):
            shutil.copyfile(source, staging / "podagent" / source.name)
        os.chmod(staging, 0o755)  # noqa: S103 - read by sandboxes' unprivileged ids
        try:
            os.rename(staging, target.parent)
        except OSError:
            if not target.is_dir():  # else: a concurrent publisher won, same bytes
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_token(secret_dir: Path, token: str) -> Path:
    secret_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(secret_dir, 0o700)
    path = secret_dir / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def launch_detached(
    argv: Sequence[str],
    *,
    cgroup_dirs: Sequence[Path],
    log_file: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    pass_fds: Sequence[int] = (),
) -> tuple[int, int]:
    """Start ``argv`` detached (own session, reparented to init) inside ``cgroup_dirs``.

    Returns (pid, start_time) of the process that ends up exec'ing ``argv[...]``.
    """
    chain: list[str] = list(argv)
    if cgroup_dirs:
        chain = [
            "/bin/sh",
            "-c",
            _JOIN_CGROUPS,
            "hedgerow-cgjoin",
            *map(str, cgroup_dirs),
            "--",
            *chain,
        ]
    proc = subprocess.run(
        ["/bin/sh", "-c", _LAUNCH, "hedgerow-launch", str(log_file), *chain],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=10,
        env=env if env is not None else {"PATH": SYSTEM_PATH},
        cwd=cwd,
        pass_fds=tuple(pass_fds),
        check=False,
    )
    try:
        pid = int(proc.stdout.strip())
    except ValueError as exc:
        raise BackendError(f"agent launch failed: {proc.stderr.strip()}") from exc
    start = proc_start_time(pid)
    if start is None:
        raise BackendError(f"agent exited at once: {tail(log_file)}")
    return pid, start


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""
