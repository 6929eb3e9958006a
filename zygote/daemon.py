"""The agent zygote: starts sandbox agents as forks of one already-imported process.

    python -m zygote --socket PATH   (the local backend starts it: backends/local/zygote.py)

The backend's code, not the agent's: it runs as host root and forks agents, so it lives
beside ``podagent/`` (which is what runs inside sandboxes) rather than in it, and is
never published into a sandbox.

Starting a sandbox's agent as bubblewrap's payload pays a Python interpreter start and
the agent's imports (40-70 ms CPU) per sandbox. Here bubblewrap still builds the
sandbox (namespaces, mounts, --cap-drop ALL) but runs a tiny static ``pause`` binary;
the agent is a fork of this daemon entered into pause's namespaces:

1. per request the main loop (which only accepts, forks and reaps) forks a handler,
   which becomes the agent's *seed* and forks the *worker*: the worker reads the
   request, joins the sandbox's cgroups, netns and user namespace and posix_spawns
   bwrap in a new session;
2. pause writes one byte to the *ready* pipe once bwrap's mounts are done;
3. the worker hands the seed an order (what the agent needs of the request, and the
   descriptors); the seed joins the same cgroups, netns and user namespace, setns()es
   into pause's cgroup/ipc/uts/pid/mnt namespaces, chroots to pause's root and forks
   the agent (the pid namespace applies to children only), which drops every
   capability, sets the environment bwrap would have set, keeps only stdout/stderr
   and the *hold* pipe and runs ``podagent.__main__.main``. The seed has written to
   few of the zygote's pages, so the agent inherits few private ones (_seed).

The agent holds the only write end of the hold pipe: when it dies, pause reads EOF and
exits, bwrap's pid-namespace init exits and the kernel kills everything in the
sandbox, as when an exec-started agent dies. Nothing here ever keeps a copy of it.

After setns(mnt) the host's Python library is not visible, so everything the agent
may import is imported here first, and a late import fails loudly (ImportError plus a
line in agent.log) instead of reading whatever the sandbox has at that path.

The protocol is one JSON line each way per connection on a 0600 unix socket.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import ctypes
import errno
import fcntl
import gc
import hashlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, NoReturn, Optional, Sequence

import podagent
from podagent import __main__ as agent_main
from podagent import (
    limits,
    pty_session,  # noqa: F401 - imported by the server on the first PTY
    seccomp,
    userns,
)
from podagent.spawn import AGENT_UID

# Everything the agent imports late: it cannot import after setns. Found by logging
# every import of agents run through podagent/tests (encodings.idna, stringprep,
# unicodedata: socket calls with str hosts; resource: subprocess limits; ast: 3.11's
# traceback, when it formats an error with source lines at hand).
PRELOAD = (
    "ast",
    "encodings.ascii",
    "encodings.idna",
    "encodings.latin_1",
    "encodings.unicode_escape",
    "resource",
    "unicodedata",
)
for _name in PRELOAD:
    __import__(_name)
# The codecs a handler uses (_mount_points), looked up here: a handler's first lookup
# imported encodings.unicode_escape, ~0.5 MiB of pages every agent then inherited.
for _codec in ("unicode_escape", "latin-1"):
    codecs.lookup(_codec)
# The host's import finders (FileFinders and their directory listings): an agent
# replaces sys.path_importer_cache rather than clearing it, since freeing them wrote to
# (copied) ~0.5 MiB of the zygote's pages per agent. This reference keeps them alive.
_HOST_IMPORTER_CACHE = sys.path_importer_cache

PODAGENT_DIR = os.path.dirname(os.path.abspath(podagent.__file__))
ZYGOTE_DIR = os.path.dirname(os.path.abspath(__file__))

# fd numbers bwrap and pause get (argv names them); chosen above 2 and fixed, and set
# with dup2 from higher numbers, so they are never a no-op dup2 that keeps O_CLOEXEC.
# SECCOMP_FD: bwrap's --seccomp; ARGS_FD: bwrap's --args (its options, so that no host
# path is in its argv: the sandbox's /proc/1/cmdline); TOKEN_FD: the agent's token, which
# bwrap copies into the sandbox (--file).
READY_FD, HOLD_FD, INFO_FD, SECCOMP_FD, ARGS_FD, TOKEN_FD = 3, 4, 5, 6, 7, 8
NAMESPACES = (  # setns order: mnt last (after it /proc/<pause>/ns is another /proc)
    # not net: the seed joined it first (as host root: the netns belongs to the
    # initial user namespace, and the sandbox's root has no capability over it)
    ("cgroup", 0x02000000),
    ("ipc", 0x08000000),
    ("uts", 0x04000000),
    ("pid", 0x20000000),
    ("mnt", 0x00020000),
)
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MNT_DETACH = 2
# Hidden from the mount namespace bwrap starts in (see make_launcher_ns): /run/netns
# holds one nsfs mount per live sandbox of the machine, /sys a dozen cgroup mounts;
# a sandbox binds neither, and the handler is done with both before it enters.
LAUNCHER_HIDDEN = ("/run/netns", "/sys")
PR_SET_DUMPABLE = 4
OOM_SCORE_ADJ_AGENT = -1000
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# modules that are absent on Linux anyway: a late try-import of these is no news
_ABSENT_ANYWAY = {"_winapi", "msvcrt", "winreg", "nt", "_overlapped", "org", "java"}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
# Resolved here, before any fork: a CDLL caches each function on first use, which in a
# seed or an agent wrote to (copied) the zygote's pages. limits' prctl likewise.
for _fn in ("setns", "prctl", "capset", "unshare"):
    getattr(_libc, _fn)
limits.libc_prctl()
# fd of the launcher mount namespace (make_launcher_ns), inherited by every handler;
# None: bwrap starts in the zygote's own (not root, or it could not be made)
_launcher_mnt: Optional[int] = None
# the sandbox's seccomp program, compiled once by the daemon before any fork: agents
# load it after setns, where libseccomp need not exist (serve)
_seccomp_bpf: Optional[bytes] = None
# the commands' extra filter where they keep capabilities (seccomp.guard_rules)
_guard_bpf: Optional[bytes] = None
# the commands' filter in every sandbox: no renicing the agent (seccomp.nice_rules)
_nice_bpf: Optional[bytes] = None


class ZygoteError(Exception):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage


def source_version(directory: str = PODAGENT_DIR, zygote_dir: str = ZYGOTE_DIR) -> str:
    """Hash of the agent's and the zygote's sources: a zygote of other code must be
    replaced."""
    h = hashlib.sha256()
    for prefix, folder in (("", directory), ("zygote/", zygote_dir)):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as fh:
                    h.update((prefix + name).encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()[:16]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _setns(fd: int, nstype: int, what: str) -> None:
    _check(_libc.setns(fd, nstype), f"setns({what})")


def _set_name(name: str) -> None:
    # /proc/<pid>/comm: tells the zygote, its handlers and agents apart in ps/bench
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_all_capabilities(keep: Sequence[int] = ()) -> None:
    """What bwrap --cap-drop ALL (and --cap-add ``keep``) leaves a root process:
    bounding, permitted, effective and inheritable sets of ``keep`` only (empty by
    default), no ambient set, and no_new_privs. With no_new_privs a command the
    agent starts as root gets at most ``keep``; as another uid, nothing."""
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        if cap in keep:
            continue
        # EINVAL: a capability this kernel does not know; anything else is fatal
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, f"PR_CAPBSET_DROP {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient clear")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for cap in keep:
        word, bit = divmod(cap, 32)
        data[word].effective |= 1 << bit
        data[word].permitted |= 1 << bit
        data[word].inheritable |= 1 << bit
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


class _LateImportGuard:
    """First on sys.meta_path in an agent: anything not imported by the zygote fails."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        message = f"podagent: late import of {name!r} in a zygote-started agent"
        if name.split(".")[0] not in _ABSENT_ANYWAY:
            os.write(2, (message + " (add it to zygote/daemon.py)\n").encode())
        raise ModuleNotFoundError(message, name=name)


def _proc_start_time(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _join_cgroups(cgroups: List[str]) -> None:
    for directory in cgroups:
        with open(os.path.join(directory, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))


def _open_cgroup_files(files: Dict[str, List[str]]) -> Dict[str, List[int]]:
    """Opens the sandbox's cgroup files the agent uses (podagent/limits.py) while this
    worker still sees the host's /sys and has privilege: ``*_tasks`` for writing, the
    counters and limits for reading. The agent gets the descriptors, never the paths."""
    fds: Dict[str, List[int]] = {}
    for name, paths in files.items():
        flags = (os.O_WRONLY if name.endswith("_tasks") else os.O_RDONLY) | os.O_CLOEXEC
        fds[name] = [os.open(path, flags) for path in paths]
    return fds


def _mount_points() -> List[str]:
    with open("/proc/self/mountinfo") as fh:
        lines = fh.read().splitlines()
    # field 5 is the mount point, with space, tab, newline and backslash octal-escaped
    return [
        line.split(" ")[4].encode().decode("unicode_escape").encode("latin-1").decode()
        for line in lines
    ]


def _under(path: str, prefixes: "tuple[str, ...]") -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _hide_mounts(prefixes: "tuple[str, ...]") -> None:
    """Detaches every mount at or below ``prefixes`` in this mount namespace, deepest
    first (the host's table is untouched: the namespace is a slave copy)."""
    for point in sorted({p for p in _mount_points() if _under(p, prefixes)}, key=len, reverse=True):
        # stacked mounts (the same point mounted twice) need one umount each
        while _libc.umount2(point.encode(), MNT_DETACH) == 0:
            pass
    left = [p for p in _mount_points() if _under(p, prefixes)]
    if left:
        raise OSError(errno.EBUSY, f"still mounted after detaching: {left[:5]}")


def hide_other_roots(roots_dir: str, keep: str) -> None:
    """Detaches every mount below ``roots_dir`` but ``keep`` (and what is below it) in
    this mount namespace, a slave copy: the host's and the launcher's tables are
    untouched. One read of the table and one umount per other live image sandbox."""
    prefix = roots_dir.rstrip("/") + "/"
    others = {
        p
        for p in _mount_points()
        if p.startswith(prefix) and not (keep and (p == keep or p.startswith(keep + "/")))
    }
    for point in sorted(others, key=len, reverse=True):
        while _libc.umount2(point.encode(), MNT_DETACH) == 0:
            pass


def make_launcher_ns(hidden: "tuple[str, ...]" = LAUNCHER_HIDDEN) -> int:
    """An fd of a mount namespace to start bwrap in: a slave copy of this process's,
    without the mounts at or below ``hidden``.

    bwrap copies its starting namespace's whole mount table when it unshares, re-reads
    /proc/self/mountinfo after each of its ~20 binds and detaches the old root's mounts
    at the end: its CPU grows with every line of that table. The host's has one
    /run/netns mount per live sandbox, so with 200 live sandboxes a bwrap cost ~29 ms
    instead of ~6. Without those lines the cost no longer depends on how many
    sandboxes live. What a sandbox sees is unchanged: it binds nothing from /run/netns
    or /sys, and mounts made later in the host's shared subtrees still propagate into
    the copy (slave), except below ``hidden``, whose mount points are gone from it.

    Made by a short-lived child (unshare would move the zygote itself), whose
    namespace lives on through the returned fd.
    """
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(done_w)
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _check(_libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "make / rslave")
            _hide_mounts(hidden)
            os.write(ready_w, b"1")
            os.read(done_r, 1)  # EOF: the parent holds the namespace now
            code = 0
        except BaseException:  # noqa: BLE001 - reported by the parent as a failure
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError(errno.EPERM, "could not make the launcher mount namespace")
        return os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.waitpid(pid, 0)


class _Stage:
    """Turns any failure inside into a ZygoteError naming the launch stage."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None and not isinstance(exc, ZygoteError):
            raise ZygoteError(self.stage, f"{type(exc).__name__}: {exc}") from exc


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _args_memfd(args: List[str]) -> int:
    return _memfd("bwrap-args", b"".join(arg.encode() + b"\0" for arg in args))


def _start_bwrap(req: Dict[str, Any], log_fd: int, ready_w: int, hold_r: int, info_w: int) -> int:
    """Spawns bwrap in a new session (the caller is in the sandbox's cgroups and netns,
    and is root of its user namespace). Its options come by --args, the seccomp program
    by --seccomp.

    posix_spawn (vfork) rather than fork+exec: a fork of this large process would copy,
    then on exec tear down, its whole address space for every sandbox.
    """
    if _seccomp_bpf is None:
        raise ZygoteError("bwrap: seccomp", "the zygote has no seccomp program")
    with _Stage("bwrap: fds"):
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        bpf = seccomp.memfd(_seccomp_bpf)
        args = _args_memfd(req["bwrap_args"])
        token = _memfd("token", req["token"].encode())
        # CLOEXEC copies above 63: a dup2 action onto 0..7 then always changes the number
        # (a same-number dup2 would keep O_CLOEXEC) and the copies do not leak into bwrap
        high = [
            fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64)
            for fd in (null, log_fd, log_fd, ready_w, hold_r, info_w, bpf, args, token)
        ]
        for fd in (bpf, args, token):
            os.close(fd)
    argv = [req["bwrap"], "--args", str(ARGS_FD), "--", *req["payload"]]
    try:
        targets = (0, 1, 2, READY_FD, HOLD_FD, INFO_FD, SECCOMP_FD, ARGS_FD, TOKEN_FD)
        actions = [(os.POSIX_SPAWN_DUP2, src, dst) for src, dst in zip(high, targets, strict=True)]
        with _Stage("bwrap: exec"):
            return os.posix_spawn(
                argv[0],
                argv,
                req["bwrap_env"],
                file_actions=actions,
                setsid=True,
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),  # Python ignores them
            )
    finally:
        for fd in (null, *high):
            os.close(fd)


def _wait_ready(bwrap_pid: int, ready_r: int, info_r: int, deadline: float) -> int:
    """Waits for pause's byte; returns the pid of bwrap's pid-namespace init."""
    left = max(0.0, deadline - time.monotonic())
    if not select.select([ready_r], [], [], left)[0]:
        os.kill(bwrap_pid, signal.SIGKILL)
        os.waitpid(bwrap_pid, 0)
        raise ZygoteError("ready", "the sandbox did not become ready in time (bwrap killed)")
    if os.read(ready_r, 1) != b"r":
        _, status = os.waitpid(bwrap_pid, 0)
        raise ZygoteError(
            "ready", f"bwrap exited before the sandbox was ready (status {status:#x})"
        )
    info = b""
    while True:  # bwrap writes {"child-pid": N, ...} before the setup; complete by now
        if not select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise ZygoteError("ready", "no --info-fd answer from bwrap")
        chunk = os.read(info_r, 4096)
        info += chunk
        try:
            return int(json.loads(info)["child-pid"])
        except ValueError:
            if not chunk:
                raise ZygoteError("ready", f"bad --info-fd answer: {info!r}") from None


def _wait_listening(listening_r: int, deadline: float) -> None:
    """Waits for the agent's byte saying its socket listens (EOF: it died first)."""
    try:
        left = max(0.0, deadline - time.monotonic())
        if not select.select([listening_r], [], [], left)[0]:
            raise ZygoteError("agent", "the agent did not listen in time")
        if os.read(listening_r, 1) != b"1":
            raise ZygoteError("agent", "the agent exited before it listened (see agent.log)")
    finally:
        os.close(listening_r)


def _enter_sandbox(req: Dict[str, Any], pause: int) -> None:
    """Moves this process into pause's namespaces and root (the cgroups are joined)."""
    with _Stage("agent: open namespaces"):
        root = os.open(f"/proc/{pause}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fds = [
            (os.open(f"/proc/{pause}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC), flag, ns)
            for ns, flag in NAMESPACES
        ]
    for fd, flag, ns in fds:
        with _Stage(f"agent: setns({ns})"):
            _setns(fd, flag, ns)
        os.close(fd)
    with _Stage("agent: chroot"):
        # setns(mnt) leaves us at the namespace's root, which is not the sandbox's
        # (bwrap pivots); pause's root directory is.
        os.fchdir(root)
        os.chroot(".")
        os.chdir(req["workdir"])
        os.close(root)


class _Inherited:
    """Python objects owning fds the agent must lose without a later close by the
    garbage collector hitting a reused fd number: detached, then closed by number."""

    def __init__(self) -> None:
        self.sockets: List[socket.socket] = []

    def detach_all(self) -> None:
        for sock in self.sockets:
            sock.detach()
        self.sockets.clear()


def _agent_main(
    req: Dict[str, Any],
    null: int,
    log_fd: int,
    hold_w: Optional[int],
    keep: _Inherited,
    listening_w: Optional[int] = None,
    cgroup_fds: Optional[Dict[str, List[int]]] = None,
) -> NoReturn:
    code = 1
    try:
        _set_name("hedgerow-agent")
        os.setsid()
        signal.alarm(0)
        for sig in (signal.SIGALRM, signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        keep.detach_all()
        # Kept: the hold pipe (a plain agent in tests has no sandbox to hold) and the
        # pipe that says "listening"; close-on-exec, so commands never inherit them.
        # The sandbox's cgroup files too (limits.py).
        cgroup_fds = cgroup_fds or {}
        wanted = [fd for fd in (hold_w, listening_w) if fd is not None]
        wanted += [fd for fds in cgroup_fds.values() for fd in fds]
        moved = {fd: fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in wanted}
        low = 3
        for fd in sorted(moved.values()):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        agent_args = list(req["agent_args"])
        if listening_w is not None:
            agent_args += ["--listening-fd", str(moved[listening_w])]
        if cgroup_fds:
            renumbered = {name: [moved[fd] for fd in fds] for name, fds in cgroup_fds.items()}
            agent_args += ["--cgroup-fds", limits.format_fds(renumbered)]
        if hold_w is not None:
            # The sandbox's commands run as other real uids than the agent's, so none
            # may signal it (`kill -9 -1`, pkill, its pid by number): real and saved
            # uid the agent uid, effective (files, permissions) still the sandbox's
            # root. Commands get every uid set to the effective one (--exec-helper).
            os.setresuid(AGENT_UID, os.geteuid(), AGENT_UID)
        if hold_w is not None or os.geteuid() == 0:
            # and no_new_privs; an image sandbox's root keeps the container default set
            drop_all_capabilities([int(c) for c in req.get("caps") or []])
        if hold_w is not None:
            # the sandbox's filter, as bwrap gave pause: the agent is no bwrap descendant
            assert _seccomp_bpf is not None  # spawn checked it
            seccomp.load(_seccomp_bpf)
            assert _nice_bpf is not None
            seccomp.load(_nice_bpf)
            if req.get("caps"):
                # an image's root keeps CAP_KILL/CAP_SETUID over this user namespace:
                # the agent's uid alone does not keep its commands from signalling it
                assert _guard_bpf is not None
                seccomp.load(_guard_bpf)
        # Not dumpable: the sandbox's commands (same uid) cannot ptrace it or read its
        # /proc maps/environ/exe, which would show the host's interpreter and paths.
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")
        os.umask(int(req["umask"]))
        os.environ.clear()
        os.environ.update(req["env"])
        sys.meta_path.insert(0, _LateImportGuard())
        sys.path[:] = []
        sys.path_importer_cache = {}  # the host's stay referenced: _HOST_IMPORTER_CACHE
        sys.argv = ["podagent", *agent_args]
        code = agent_main.main(agent_args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the agent's last words go to agent.log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn_plain(req: Dict[str, Any], keep: _Inherited) -> Dict[str, Any]:
    """An agent forked without a sandbox, in ``workdir``: lets podagent's own tests run
    against a zygote-started agent (PODAGENT_TEST_LAUNCH=zygote), late-import guard
    and all."""
    with _Stage("plain agent"):
        log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        os.chdir(req["workdir"])
    agent_pid = os.fork()
    if agent_pid == 0:
        _agent_main(req, null, log_fd, None, keep)
    return {"ok": True, "agent_pid": agent_pid}


def spawn(req: Dict[str, Any], seed: socket.socket) -> Dict[str, Any]:
    """Starts one sandbox (bwrap + pause) and has ``seed`` start its agent. Runs in a
    throwaway worker, which therefore does the joining itself: the cgroups and netns
    (inherited by bwrap), the user namespace bwrap starts in. Once pause is ready, the
    seed (_seed: this worker's parent, a fork of the zygote that has done nothing else)
    joins the same, then the sandbox's namespaces and root, and forks the agent there
    (the pid namespace applies to children only)."""
    deadline = time.monotonic() + float(req.get("timeout", 10))
    with _Stage("open agent.log"):
        log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)  # the agent's stdin
    with _Stage("join cgroups"):
        _join_cgroups(req["cgroups"])  # before the netns (and setns(cgroup), later)
        cgroup_fds = _open_cgroup_files(req.get("cgroup_files") or {})
    with _Stage("oom_score_adj"):
        _lower_oom_score()
    with _Stage("enter netns"):
        nsfd = os.open(req["netns"], os.O_RDONLY | os.O_CLOEXEC)  # kept for the seed
        _setns(nsfd, CLONE_NEWNET, req["netns"])
    with _Stage("make user namespace"):
        userns_fd = userns.make(int(req["uid_base"]), req["pause"])
    if _launcher_mnt is not None:
        # last: every host path of the request (log, cgroups, netns) is open or done
        with _Stage("enter launcher mount namespace"):
            _setns(_launcher_mnt, CLONE_NEWNS, "launcher mnt")
    if req.get("roots_dir"):
        # Image sandboxes' roots reach the launcher namespace by propagation, one mount
        # per live image sandbox: bwrap's cost grows with every line of the table it
        # copies (make_launcher_ns), so this handler's own copy keeps only its root.
        with _Stage("hide other sandboxes' roots"):
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            hide_other_roots(req["roots_dir"], req.get("root") or "")
    # Root of the sandbox's user namespace from here on: bwrap, pause, the agent and
    # every command run as host ids uid_base.., and the namespaces bwrap makes are
    # that namespace's (the netns, joined above, stays the host's).
    with _Stage("enter user namespace"):
        userns.enter(userns_fd)  # the fd stays open: the seed enters it too
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    info_r, info_w = os.pipe()
    try:
        bwrap_pid = _start_bwrap(req, log_fd, ready_w, hold_r, info_w)
    finally:
        for fd in (ready_w, hold_r, info_w):
            os.close(fd)
    init_pid = 0
    try:
        init_pid = _wait_ready(bwrap_pid, ready_r, info_r, deadline)
        pause = init_pid  # bwrap --as-pid-1: pause is the sandbox's pid 1
        # the host's /proc: after _enter_sandbox, /proc is the sandbox's
        started = {
            "bwrap_start_time": _proc_start_time(bwrap_pid),
            "init_start_time": _proc_start_time(init_pid),
        }
        # The answer waits until the agent listens: the backend's first readiness probe
        # then succeeds instead of being refused and retried after a sleep.
        listening_r, listening_w = os.pipe()
        try:
            agent_pid = _start_agent_by_seed(
                seed,
                req,
                pause,
                deadline,
                [null, log_fd, hold_w, listening_w, nsfd, userns_fd],
                cgroup_fds,
            )
        finally:
            os.close(listening_w)
        _wait_listening(listening_r, deadline)
    except BaseException:
        # pause reads EOF once hold_w is closed; the kill covers a pause never started
        os.close(hold_w)
        for pid in (init_pid, bwrap_pid):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(bwrap_pid, 0)
        raise
    os.close(hold_w)  # the agent's is now the only write end
    return {
        "ok": True,
        "bwrap_pid": bwrap_pid,
        "init_pid": init_pid,
        "pause_pid": pause,
        **started,
        "agent_pid": agent_pid,
    }


# What of a spawn request the agent's start needs (_enter_sandbox, _agent_main): all the
# seed is given of it.
_AGENT_KEYS = ("agent_args", "caps", "env", "umask", "workdir")
# null, log, hold_w, listening_w, netns, userns: the fds every order carries first
_ORDER_FDS = 6
_LENGTH = 8  # bytes of an order's length prefix
_FD_SIZE = 4  # a C int in SCM_RIGHTS data


def _start_agent_by_seed(
    seed: socket.socket,
    req: Dict[str, Any],
    pause: int,
    deadline: float,
    fds: List[int],
    cgroup_fds: Dict[str, List[int]],
) -> int:
    """The worker's side: hands the seed the order and the descriptors (SCM_RIGHTS) it
    needs to start the agent in the sandbox; returns the agent's pid."""
    everything = list(fds)
    named: Dict[str, List[int]] = {}
    for name, group in cgroup_fds.items():
        named[name] = list(range(len(everything), len(everything) + len(group)))
        everything += group
    order = {key: req.get(key) for key in _AGENT_KEYS}
    order.update({"pause": pause, "cgroups": req["cgroups"], "cgroup_fds": named})
    payload = json.dumps(order).encode()
    with _Stage("agent: hand to the seed"):
        socket.send_fds(seed, [len(payload).to_bytes(_LENGTH, "big")], everything)
        seed.sendall(payload)
        left = max(0.0, deadline - time.monotonic())
        if not select.select([seed], [], [], left)[0]:
            raise ZygoteError("agent", "the seed did not start the agent in time")
        raw = seed.recv(65536)
    if not raw:
        raise ZygoteError("agent", "the seed exited before it started the agent")
    answer = json.loads(raw)
    if not answer.get("ok"):
        raise ZygoteError(str(answer.get("stage")), str(answer.get("error")))
    return int(answer["agent_pid"])


def _read_order(sock: socket.socket) -> "tuple[Optional[Dict[str, Any]], List[int]]":
    """The seed's side of _start_agent_by_seed: (None, []) on EOF (the request was no
    spawn, or it failed before the agent)."""
    # recvmsg itself: socket.recv_fds drops its flags argument (3.11), and the fds must
    # come close-on-exec
    head, ancillary, _, _ = sock.recvmsg(
        _LENGTH, socket.CMSG_LEN(64 * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
    )
    fds: List[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_SIZE
            fds += [
                int.from_bytes(data[i : i + _FD_SIZE], sys.byteorder, signed=True)
                for i in range(0, usable, _FD_SIZE)
            ]
    if not head:
        return None, []
    while len(head) < _LENGTH:
        more = sock.recv(_LENGTH - len(head))
        if not more:
            raise ZygoteError("seed", "the worker's order ended early")
        head += more
    size = int.from_bytes(head, "big")
    chunks: List[bytes] = []
    while size > 0:
        chunk = sock.recv(min(size, 1 << 16))
        if not chunk:
            raise ZygoteError("seed", "the worker's order ended early")
        chunks.append(chunk)
        size -= len(chunk)
    order: Dict[str, Any] = json.loads(b"".join(chunks))
    if len(fds) < _ORDER_FDS:
        raise ZygoteError("seed", f"the worker's order came with {len(fds)} descriptors")
    return order, fds


def _lower_oom_score() -> None:
    # bwrap, pause and the agent: never the OOM killer's choice, on cgroup v1 (a thread
    # visiting the commands' group to spawn) and v2 (one group for all). Lowering it
    # needs CAP_SYS_RESOURCE in the initial user namespace, which a container may not
    # give (then they keep the zygote's); the exec helper raises every command's to 500
    # either way, which needs no privilege.
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write(str(OOM_SCORE_ADJ_AGENT))
    except PermissionError:
        pass


def _seed(sock: socket.socket) -> None:
    """The agent's parent: a fork of the zygote that has done nothing but wait for its
    worker's order (the request, bwrap and the waits are the worker's, its child).

    An agent's private memory is every zygote page that it or its parent wrote to: the
    parent's copies become the agent's alone once the parent exits. Forked from the
    worker, an agent kept ~0.8 MiB of pages only the worker had touched
    (docs/benchmarks.md "Density"). The seed joins exactly what the worker joined for
    bwrap (the sandbox's cgroups, netns, user namespace), then pause's namespaces and
    root, and forks the agent there, as the worker did."""
    order, fds = _read_order(sock)
    if order is None:
        return
    try:
        null, log_fd, hold_w, listening_w, nsfd, userns_fd = fds[:_ORDER_FDS]
        cgroup_fds = {name: [fds[i] for i in idx] for name, idx in order["cgroup_fds"].items()}
        with _Stage("agent: join cgroups"):
            _join_cgroups(order["cgroups"])
        with _Stage("agent: oom_score_adj"):
            _lower_oom_score()
        with _Stage("agent: enter netns"):
            _setns(nsfd, CLONE_NEWNET, "netns")
            os.close(nsfd)
        with _Stage("agent: enter user namespace"):
            userns.enter(userns_fd)
            os.close(userns_fd)
        _enter_sandbox(order, int(order["pause"]))
        keep = _Inherited()
        keep.sockets.append(sock)
        agent_pid = os.fork()
        if agent_pid == 0:
            _agent_main(order, null, log_fd, hold_w, keep, listening_w, cgroup_fds)
        answer: Dict[str, Any] = {"ok": True, "agent_pid": agent_pid}
    except ZygoteError as exc:
        answer = {"ok": False, "stage": exc.stage, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - every failure is answered, typed
        answer = {"ok": False, "stage": "seed", "error": f"{type(exc).__name__}: {exc}"}
    sock.sendall(json.dumps(answer).encode())


# ---- the daemon ------------------------------------------------------------------------


def _handle(
    conn: socket.socket, keep: _Inherited, version: str, zygote: int, seed: socket.socket
) -> Dict[str, Any]:
    conn.settimeout(10)
    raw = b""
    while not raw.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        raw += chunk
    req = json.loads(raw)
    op = req.get("op")
    if op == "ping":
        # the interpreter it runs: the backend replaces a zygote of another
        return {"ok": True, "pid": zygote, "version": version, "exe": os.readlink("/proc/self/exe")}
    if op == "shutdown":
        os.kill(zygote, signal.SIGTERM)
        return {"ok": True}
    if op == "spawn":
        # a backstop: every wait inside has its own deadline
        signal.alarm(int(float(req.get("timeout", 10))) + 20)
        return spawn(req, seed)
    if op == "spawn_plain":
        return spawn_plain(req, keep)
    return {"ok": False, "stage": "request", "error": f"unknown op {op!r}"}


def _work(
    conn: socket.socket, listener: socket.socket, version: str, zygote: int, seed: socket.socket
) -> None:
    keep = _Inherited()
    keep.sockets += [listener, conn, seed]
    try:
        answer = _handle(conn, keep, version, zygote, seed)
    except ZygoteError as exc:
        answer = {"ok": False, "stage": exc.stage, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - every failure is answered, typed
        answer = {"ok": False, "stage": "zygote", "error": f"{type(exc).__name__}: {exc}"}
    conn.settimeout(10)
    conn.sendall(json.dumps(answer).encode() + b"\n")


def _serve_one(conn: socket.socket, listener: socket.socket, version: str) -> NoReturn:
    """One request. This fork of the zygote becomes the seed of the agent (_seed) and
    forks the worker that reads and serves the request: the agent's parent then has
    written to as few of the zygote's pages as it can."""
    code = 0
    try:
        _set_name("hedgerow-zyghdl")
        zygote = os.getppid()
        seed, work = socket.socketpair()
        if os.fork() != 0:
            for sock in (conn, listener, work):
                sock.close()
            _seed(seed)
        else:
            seed.close()
            _work(conn, listener, version, zygote, work)
    except BaseException:  # noqa: BLE001 - a handler never returns into the loop
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(path: str) -> int:
    """Binds ``path``, then daemonizes: the starting process exits 0 once the socket
    listens (the backend waits for that), the daemon serves until the socket file is
    removed or replaced (instance torn down) or it is told to shut down."""
    global _launcher_mnt, _seccomp_bpf, _guard_bpf, _nice_bpf
    version = source_version()
    # before the fork below: without libseccomp the zygote does not start (the backend
    # sees its exit status and error), rather than starting unfiltered sandboxes
    _seccomp_bpf = seccomp.program()
    _guard_bpf = seccomp.compile_filter(seccomp.guard_rules(AGENT_UID))
    _nice_bpf = seccomp.compile_filter(seccomp.nice_rules(AGENT_UID))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # the backend starts us under its lock, after a failed ping
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)
    listener.bind(path)
    os.umask(old_umask)
    listener.listen(256)
    inode = os.stat(path).st_ino
    if os.fork() != 0:
        os._exit(0)
    os.setsid()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _set_name("hedgerow-zygote")
    if os.geteuid() == 0:
        try:
            _launcher_mnt = make_launcher_ns()
        except OSError as exc:
            print(f"zygote: bwrap starts in the host's mount namespace: {exc}", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Orphans (bwrap, agents: their handler exits at once) come to us rather than to
    # the host's init, and are reaped at once: a sandbox's cgroups cannot be removed
    # while a zombie of it is left unreaped.
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "PR_SET_CHILD_SUBREAPER")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    # objects created at import never change again: keep the collector away from
    # them so forked agents share those pages instead of copying them
    gc.collect()
    gc.freeze()
    print(f"zygote {os.getpid()} listening on {path} (version {version})", flush=True)
    while not stopping:
        try:
            readable = select.select([listener, wake_r], [], [], 1.0)[0]
        except InterruptedError:
            readable = []
        _reap()
        try:
            if os.stat(path).st_ino != inode:
                break
        except FileNotFoundError:
            break
        if wake_r in readable:
            os.read(wake_r, 4096)
        if listener not in readable:
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        try:
            if os.fork() == 0:
                signal.set_wakeup_fd(-1)  # before anything may close or reuse wake_w
                for sig in (signal.SIGTERM, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                _serve_one(conn, listener, version)
        finally:
            conn.close()
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zygote")
    parser.add_argument("--socket", required=True)
    args = parser.parse_args(argv)
    return serve(args.socket)


if __name__ == "__main__":
    sys.exit(main())
