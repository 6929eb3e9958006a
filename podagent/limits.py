"""The sandbox's resource limits as the agent sees them: where commands are started
and how their exhaustion is named.

The launcher (the zygote's handler, or the exec launch's shell) puts the agent in its
own cgroups (``<sandbox>/agent``) and hands it descriptors it opened while it still
had privilege (``--cgroup-fds``):

* ``cmd_tasks`` / ``agent_tasks``: the ``tasks`` files of ``<sandbox>/cmds`` and of
  the agent's group (cgroup v1: memory and pids; the agent's memory group is the
  sandbox's own, its pids group ``<sandbox>/agent``). A command is started from a thread
  that moves itself into ``cmds`` just for the spawn (a ``tasks`` write moves one
  thread, ~10 us), so the command and everything it forks are charged to ``cmds`` from
  their first instruction: the commands' OOM killer never picks the agent, and a fork
  bomb cannot take the pids the agent needs for its own threads.
* ``oom`` / ``pids_events``: ``memory.oom_control`` (v1) or ``memory.events`` (v2)
  and ``pids.events`` of the commands' cgroup, whose ``oom_kill`` and ``max`` counters
  say whether the memory cgroup's OOM killer ran or a fork was refused at pids.max
  while a command ran. ``memory_max`` / ``pids_max`` give the limits to report.

A descriptor is used only through a read or write of a few bytes: nothing of the
host's file system is visible to the agent. Without them (tests, unisolated sandboxes,
cgroup v2) commands run in the agent's cgroup and only what the counters show is named.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

T = TypeVar("T")

Snapshot = Tuple[Optional[int], Optional[int]]  # (oom kills, refused forks)

_EMPTY: Snapshot = (None, None)
# A write the quota refused leaves at most about one write's size unused: a sandbox
# this close to its disk limit (or 1/256 of it) is full.
DISK_MARGIN = 1 << 20


class Watch:
    """What a running command started with: the counters, and whether another command
    ran beside it (the counters are the whole cgroup's, not the command's own)."""

    __slots__ = ("before", "seq", "shared")

    def __init__(self, before: Snapshot, seq: int, shared: bool) -> None:
        self.before = before
        self.seq = seq
        self.shared = shared


class SpawnPlacementError(OSError):
    """The command could not be placed in the commands' cgroup (nothing was started)."""


def parse_fds(value: str) -> Dict[str, List[int]]:
    """``name=fd[:fd...],name=fd`` → {name: [fd, ...]}."""
    found: Dict[str, List[int]] = {}
    for item in value.split(","):
        if not item:
            continue
        name, sep, fds = item.partition("=")
        if not sep or not name:
            raise ValueError(f"bad --cgroup-fds item {item!r}")
        found[name] = [int(fd) for fd in fds.split(":") if fd]
    return found


def format_fds(fds: Dict[str, List[int]]) -> str:
    return ",".join(f"{name}={':'.join(map(str, v))}" for name, v in sorted(fds.items()))


def _read(fd: Optional[int]) -> Optional[str]:
    if fd is None:
        return None
    try:
        return os.pread(fd, 4096, 0).decode("ascii", "replace")
    except OSError:
        return None


def _counter(text: Optional[str], key: str) -> Optional[int]:
    if text is None:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _first(fds: Optional[List[int]]) -> Optional[int]:
    return fds[0] if fds else None


def _limit(fd: Optional[int]) -> Optional[int]:
    text = (_read(fd) or "").strip()
    return int(text) if text.isdigit() else None


class CgroupFiles:
    def __init__(self, fds: Optional[Dict[str, List[int]]] = None) -> None:
        fds = fds or {}
        self.cmd_tasks = fds.get("cmd_tasks", [])
        self.agent_tasks = fds.get("agent_tasks", [])
        self.oom = _first(fds.get("oom"))
        self.pids_events = _first(fds.get("pids_events"))
        self.memory_max = _first(fds.get("memory_max"))
        self.pids_max = _first(fds.get("pids_max"))
        # the sandbox's btrfs quota group (sysfs): bytes used, reserved, and its limit
        self.disk_used = _first(fds.get("disk_used"))
        self.disk_rsv = fds.get("disk_rsv", [])
        self.disk_max = _first(fds.get("disk_max"))
        self.sync_dir: Optional[str] = None  # the workspace: a dir on the volume
        # one thread at a time visits the commands' cgroup: a visiting thread counts
        # against its pids.max, so concurrent visitors would refuse real forks
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._running = 0
        self._started = 0

    @property
    def splits(self) -> bool:
        return bool(self.cmd_tasks) and len(self.cmd_tasks) == len(self.agent_tasks)

    def spawn(self, start: Callable[[], T]) -> T:
        """Runs ``start`` (which forks/spawns a command) from this thread while it is in
        the commands' cgroups, so the child starts there."""
        if not self.splits:
            return start()
        tid = str(threading.get_native_id()).encode()
        with self._lock:
            try:
                for fd in self.cmd_tasks:
                    os.write(fd, tid)
            except OSError as exc:
                self._back(tid)
                raise SpawnPlacementError(
                    exc.errno, f"cannot enter the commands' cgroup: {exc}"
                ) from exc
            try:
                return start()
            finally:
                self._back(tid)

    def _back(self, tid: bytes) -> None:
        for fd in self.agent_tasks:
            # Failing to leave would keep this thread in the commands' cgroup: the
            # agent would then be what the commands' OOM killer may pick. Report it.
            with contextlib.suppress(OSError):
                os.write(fd, tid)

    def snapshot(self) -> Snapshot:
        if self.oom is None and self.pids_events is None:
            return _EMPTY
        return (_counter(_read(self.oom), "oom_kill"), _counter(_read(self.pids_events), "max"))

    def begin(self) -> Watch:
        """Called before a command starts (two small reads when the counters exist)."""
        before = self.snapshot()
        with self._count_lock:
            watch = Watch(before, self._started, self._running > 0)
            self._running += 1
            self._started += 1
        return watch

    def exhausted(self, watch: Watch, termination: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Called once the command ended: what ran out while it ran, from the cgroup's
        own counters; None if nothing did.

        The counters are the whole commands' cgroup's, so a command is named only when
        the event is its own: memory when it did not succeed (the OOM killer's victim is
        a command that died of it, or a child whose death failed it); pids when it did
        not succeed or ran alone (one that carried on without the refused forks, like a
        bounded fork bomb exiting 0, was crippled all the same)."""
        with self._count_lock:
            self._running -= 1
            shared = watch.shared or self._started != watch.seq + 1
        before = watch.before
        failed = termination.get("signal") is not None or termination.get("exit_code") != 0
        if before == _EMPTY:
            return self.disk_exhausted() if failed else None
        oom_now, pids_now = self.snapshot()
        if failed and before[0] is not None and oom_now is not None and oom_now > before[0]:
            return {
                "kind": "memory",
                "limit": _limit(self.memory_max),
                "oom_kills": oom_now - before[0],
                "message": "the sandbox's memory limit was reached: the OOM killer "
                "ended the command or one of its processes",
            }
        refused = pids_now - before[1] if pids_now is not None and before[1] is not None else 0
        if refused > 0 and (failed or not shared):
            return {
                "kind": "pids",
                "limit": _limit(self.pids_max),
                "refused_forks": refused,
                "message": "the sandbox's process limit was reached: forks were refused",
            }
        return self.disk_exhausted() if failed else None

    def disk_exhausted(self) -> Optional[Dict[str, Any]]:
        """The sandbox's disk, read from its quota group after a command failed: named
        when what it uses (and has reserved) is within a write of its limit, so the
        command's writes got EDQUOT/ENOSPC. The group is the sandbox's, not the
        command's: a command failing while the disk is full is named for it."""
        limit = _limit(self.disk_max)
        if not limit or self.disk_used is None:
            return None
        if not self._disk_full(limit):
            return None
        # The group's usage is brought up to date when btrfs commits (every 30 s):
        # files deleted since still count. Looking full, commit the volume's
        # filesystem (syncfs: this one only; rare, only then) and look again.
        if self.sync_dir is not None:
            _syncfs(self.sync_dir)
        used = self._disk_used()
        if used is None or not self._disk_full(limit):
            return None
        return {
            "kind": "disk",
            "limit": limit,
            "used": used,
            "message": "the sandbox's disk quota was reached: its writes failed (EDQUOT/ENOSPC)",
        }

    def _disk_used(self) -> Optional[int]:
        used = _limit(self.disk_used)
        if used is None:
            return None
        return used + sum(_limit(fd) or 0 for fd in self.disk_rsv)

    def _disk_full(self, limit: int) -> bool:
        used = self._disk_used()
        return used is not None and limit - used <= max(DISK_MARGIN, limit // 256)

    def pids_limit(self) -> Optional[int]:
        return _limit(self.pids_max)


def _syncfs(path: str) -> None:
    import ctypes

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


CGROUPS = CgroupFiles()
_PR_SET_DUMPABLE = 4


_prctl: Optional[Callable[..., int]] = None


def libc_prctl() -> Callable[..., int]:
    """libc's prctl, looked up once: the zygote calls this before it forks, so agents
    find it resolved instead of each building the objects anew (copied pages)."""
    global _prctl
    if _prctl is None:
        import ctypes

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def not_dumpable() -> None:
    """Commands run as the agent's uid: without this they could open the agent's
    cgroup descriptors anew through /proc/<agent>/fd and move themselves out of the
    commands' cgroup. (Commands are dumpable again: exec resets it.)"""
    import ctypes

    if libc_prctl()(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def configure(fds: Dict[str, List[int]]) -> None:
    global CGROUPS
    CGROUPS = CgroupFiles(fds)
