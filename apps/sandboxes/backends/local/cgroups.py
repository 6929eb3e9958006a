"""cgroup driver: v1 (memory/cpu/pids hierarchies), v2 (unified), or none.

Sandboxes go under the control plane's own cgroup (read from /proc/self/cgroup):
``<mount>/<own path>/hedgerow-<instance>/<sandbox>``. In containers the own path
is often the only writable place (e.g. ``memory:/process_api/<id>``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from apps.sandboxes.backends.base import BackendError

from ._sys import kill_pids

CONTROLLERS = ("memory", "cpu", "pids")
# v1 only, used when present: freezes a sandbox before its processes are killed, so a
# fork bomb cannot outrun the kill (destroy)
OPTIONAL_V1 = ("freezer",)
CFS_PERIOD_US = 100_000
# v1: memory and pids are split into <sandbox>/agent and <sandbox>/cmds (podagent's
# limits.py). cmds gets the spec's limits; the sandbox's own limit adds this headroom,
# which only the agent can use: a command cannot starve the agent of memory or pids.
SPLIT = ("memory", "pids")
AGENT_GROUP, COMMANDS_GROUP = "agent", "cmds"
# Where the agent has a group of its own beside cmds (pids: its threads counted apart).
# Its memory is charged to the sandbox's own group, an inner node (v1 allows tasks
# there): the same limits (cmds ≤ the spec, cmds + agent ≤ the spec + the headroom) with
# one memory cgroup fewer per sandbox. Every memory cgroup holds a 1 KiB unit per 64
# superblocks of the machine (the kernel's per-memcg shrinker maps; a sandbox mounts
# ~7), so each costs ~N/9 KiB at N live sandboxes: ~220 KiB each at N = 2,000
# (docs/benchmarks.md "Density").
AGENT_OWN_GROUP = ("pids",)
AGENT_MEMORY_RESERVE = 64 << 20
AGENT_PIDS_RESERVE = 64


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpu_millis: int
    pids: int


def _mounts() -> tuple[dict[str, Path], Path | None]:
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(post_fields) < 3:
            continue
        fstype, mountpoint = post_fields[0], Path(fields[4])
        if fstype == "cgroup2":
            v2 = mountpoint
        elif fstype == "cgroup" and fields[3] == "/":
            for opt in post_fields[2].split(","):
                if opt in CONTROLLERS or opt in OPTIONAL_V1:
                    v1.setdefault(opt, mountpoint)
    return v1, v2


def _own_paths() -> tuple[dict[str, str], str | None]:
    v1: dict[str, str] = {}
    v2: str | None = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        for c in controllers.split(","):
            if c in CONTROLLERS or c in OPTIONAL_V1:
                v1[c] = path
    return v1, v2


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


class CgroupDriver:
    """Finds, per controller, the parent directory sandboxes are created under."""

    def __init__(self, group: str, registry: Path | None = None) -> None:
        self.group = group  # "hedgerow-<instance>"
        # Processes of one installation may sit in different cgroups (web, worker),
        # so each group dir ever used is recorded here for listing and teardown.
        self.registry = registry
        self.mode = "none"
        self.parents: dict[str, Path] = {}  # controller (or "unified") → group dir
        v1_mounts, v2_mount = _mounts()
        v1_own, v2_own = _own_paths()
        for c in CONTROLLERS:
            if c in v1_mounts and c in v1_own:
                base = v1_mounts[c] / v1_own[c].lstrip("/")
                if _writable_dir(base) and (base / "cgroup.procs").exists():
                    self.parents[c] = base / group
        if self.parents:
            self.mode = "v1"
            for c in OPTIONAL_V1:
                if c in v1_mounts:
                    base = v1_mounts[c] / v1_own.get(c, "").lstrip("/")
                    if _writable_dir(base) and (base / "cgroup.procs").exists():
                        self.parents[c] = base / group
            return
        if v2_mount is not None and v2_own is not None:
            base = v2_mount / v2_own.lstrip("/")
            avail = _read(base / "cgroup.controllers").split() if base.is_dir() else []
            if _writable_dir(base) and set(CONTROLLERS) <= set(avail):
                self.parents["unified"] = base / group
                self.mode = "v2"

    @classmethod
    def disabled(cls) -> CgroupDriver:
        driver = cls.__new__(cls)
        driver.group, driver.mode, driver.parents, driver.registry = "", "none", {}, None
        return driver

    def paths(self, sandbox_id: str) -> dict[str, Path]:
        return {c: parent / sandbox_id for c, parent in self.parents.items()}

    def create(self, sandbox_id: str, limits: Limits) -> dict[str, Path]:
        """Create the sandbox's cgroups with limits; returns controller → dir."""
        created = self.paths(sandbox_id)
        self._register()
        try:
            for controller, path in created.items():
                path.parent.mkdir(exist_ok=True)
                if self.mode == "v2":
                    # a cgroup with processes cannot delegate controllers (no internal
                    # processes rule); the group dir we made holds none.
                    _write(path.parent / "cgroup.subtree_control", "+memory +cpu +pids")
                path.mkdir(exist_ok=True)
                if self.mode == "v1" and controller in SPLIT:
                    reserved = _with_reserve(controller, limits)
                    self._limit(controller, path, reserved)
                    if controller in AGENT_OWN_GROUP:
                        (path / AGENT_GROUP).mkdir(exist_ok=True)
                    (path / COMMANDS_GROUP).mkdir(exist_ok=True)
                    self._limit(controller, path / COMMANDS_GROUP, limits)
                else:
                    self._limit(controller, path, limits)
        except OSError as exc:
            raise BackendError(f"cgroup setup failed: {exc}") from exc
        return created

    def agent_dirs(self, created: dict[str, Path]) -> list[Path]:
        """The cgroup dirs the agent (and bwrap, pause) join: ``<sandbox>/agent`` where
        it has a group of its own (v1 pids), the sandbox's own dir elsewhere."""
        return [self._agent_dir(c, path) for c, path in created.items()]

    def _agent_dir(self, controller: str, path: Path) -> Path:
        if self.mode == "v1" and controller in SPLIT and controller in AGENT_OWN_GROUP:
            return path / AGENT_GROUP
        return path

    def agent_files(self, created: dict[str, Path]) -> dict[str, list[str]]:
        """The files the launcher opens for the agent (podagent/limits.py): where to
        start commands, where to come back, and the counters that name exhaustion."""
        files: dict[str, list[str]] = {}
        if self.mode == "v1":
            split = [c for c in SPLIT if c in created]
            if len(split) == len(SPLIT):
                files["cmd_tasks"] = [str(created[c] / COMMANDS_GROUP / "tasks") for c in split]
                files["agent_tasks"] = [
                    str(self._agent_dir(c, created[c]) / "tasks") for c in split
                ]
            if "memory" in created:
                memory = created["memory"] / COMMANDS_GROUP
                files["oom"] = [str(memory / "memory.oom_control")]
                files["memory_max"] = [str(memory / "memory.limit_in_bytes")]
            if "pids" in created:
                files["pids_events"] = [str(created["pids"] / COMMANDS_GROUP / "pids.events")]
                files["pids_max"] = [str(created["pids"] / COMMANDS_GROUP / "pids.max")]
        elif self.mode == "v2" and "unified" in created:
            unified = created["unified"]
            files["oom"] = [str(unified / "memory.events")]
            files["memory_max"] = [str(unified / "memory.max")]
            files["pids_events"] = [str(unified / "pids.events")]
            files["pids_max"] = [str(unified / "pids.max")]
        return files

    def usage(self, created: dict[str, Path]) -> tuple[int, int, int, str]:
        """(memory bytes, cumulative CPU ns, pids, cpu source) of the sandbox's cgroups
        ``created`` (controller → dir, as provisioning recorded them).

        v1 reads ``memory.usage_in_bytes`` and ``pids.current`` of the sandbox's own dir
        (hierarchical: agent and cmds included). The v1 ``cpu`` controller keeps no usage
        counter (that is ``cpuacct``, not one of ours), so CPU time there is the sum of
        utime+stime+cutime+cstime of the tasks in the sandbox's pids groups, from /proc:
        a process that exits before its parent waits for it is not counted. v2 reads
        ``memory.current``, ``pids.current`` and ``cpu.stat`` ``usage_usec``. Raises
        FileNotFoundError when the sandbox has no cgroups."""
        # by the recorded dirs, not this process's mode: the web process that reads them
        # may sit in other cgroups than the worker that made them
        if "unified" in created:
            unified = created["unified"]
            stat = dict(
                line.split(" ", 1) for line in _strict_read(unified / "cpu.stat").splitlines()
            )
            return (
                int(_strict_read(unified / "memory.current")),
                int(stat.get("usage_usec", "0")) * 1000,
                int(_strict_read(unified / "pids.current")),
                "cgroup",
            )
        if "memory" not in created or "pids" not in created:
            raise FileNotFoundError("no memory and pids cgroups")
        memory = int(_strict_read(created["memory"] / "memory.usage_in_bytes"))
        pids = int(_strict_read(created["pids"] / "pids.current"))
        tasks: set[int] = set()
        for d in [created["pids"], *(p for p in created["pids"].iterdir() if p.is_dir())]:
            with contextlib.suppress(FileNotFoundError):
                tasks.update(int(x) for x in _read(d / "cgroup.procs").split())
        return memory, sum(_proc_cpu_ns(pid) for pid in tasks), pids, "proc"

    def _limit(self, controller: str, path: Path, limits: Limits) -> None:
        quota = max(1000, limits.cpu_millis * CFS_PERIOD_US // 1000)
        if controller == "memory":
            _write(path / "memory.limit_in_bytes", str(limits.memory_bytes))
            # without this the kernel swaps instead of OOM-killing (where swap exists)
            with contextlib.suppress(OSError):
                _write(path / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        elif controller == "cpu":
            _write(path / "cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(quota))
        elif controller == "pids":
            _write(path / "pids.max", str(limits.pids))
        elif controller == "unified":
            _write(path / "memory.max", str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                _write(path / "memory.swap.max", "0")
            _write(path / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            _write(path / "pids.max", str(limits.pids))

    def _register(self) -> None:
        if self.registry is None:
            return
        known = {str(p) for _, p in self.all_parents()}
        new = sorted({str(p) for p in self.parents.values()} - known)
        if new:
            with open(self.registry, "a") as f:
                f.write("".join(f"{p}\n" for p in new))

    def all_parents(self) -> list[tuple[str, Path]]:
        """This process's group dirs plus every one recorded by other processes."""
        found = dict(self.parents)
        if self.registry is not None and self.registry.exists():
            for line in self.registry.read_text().splitlines():
                path = Path(line.strip())
                # only our own group dirs under a cgroup mount, whatever the file says
                if path.name == self.group and str(path).startswith("/sys/fs/cgroup/"):
                    found.setdefault(f"{path}", path)
        return sorted(found.items())

    def listing(self) -> list[tuple[str, Path]]:
        """(controller, sandbox cgroup dir) for every sandbox cgroup of this instance."""
        found: list[tuple[str, Path]] = []
        for controller, parent in self.all_parents():
            try:
                entries = sorted(p for p in parent.iterdir() if p.is_dir())
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise BackendError(f"cannot list {parent}: {exc}") from exc
            found.extend((controller, p) for p in entries)
        return found

    def remove(self, path: Path, timeout: float = 10) -> None:
        """Kill every task in the cgroup and rmdir it (retrying while tasks drain);
        its sub-groups (agent, cmds) first."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for child in sorted(p for p in path.iterdir() if p.is_dir()):
                self.remove(child, timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                pids = [int(x) for x in _read(path / "cgroup.procs").split()]
            except FileNotFoundError:
                return
            kill_pids(pids)
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise BackendError(f"cannot remove cgroup {path}: {exc}") from exc
            time.sleep(0.05)

    def kill_frozen(self, path: Path, timeout: float = 5) -> None:
        """Freezes the freezer cgroup ``path``, SIGKILLs every task in it, thaws it.

        A fork bomb forks faster than a listing of cgroup.procs can be killed (each
        kill leaves room under pids.max for a new fork): frozen, nothing forks, and one
        listing is complete. The kills are delivered on thaw."""
        state = path / "freezer.state"
        try:
            _write(state, "FROZEN")
        except OSError:
            return  # no freezer here, or the group is gone: remove() kills as before
        deadline = time.monotonic() + timeout
        try:
            while _read(state).strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.005)
            kill_pids([int(x) for x in _read(path / "cgroup.procs").split()])
        finally:
            with contextlib.suppress(OSError):
                _write(state, "THAWED")

    @contextlib.contextmanager
    def frozen(self, path: Path, timeout: float = 5) -> Iterator[None]:
        """The freezer cgroup ``path`` frozen for the block (a snapshot's capture),
        thawed after it whatever happens. Raises BackendError when it cannot be
        frozen in ``timeout`` (a task stuck in uninterruptible sleep)."""
        state = path / "freezer.state"
        try:
            _write(state, "FROZEN")
        except OSError as exc:
            raise BackendError(f"cannot freeze {path}: {exc}") from exc
        try:
            deadline = time.monotonic() + timeout
            while _read(state).strip() != "FROZEN":
                if time.monotonic() > deadline:
                    raise BackendError(f"{path} did not freeze within {timeout} s")
                time.sleep(0.001)
            yield
        finally:
            with contextlib.suppress(OSError):
                _write(state, "THAWED")

    def remove_group(self) -> None:
        for _, parent in self.all_parents():
            with contextlib.suppress(FileNotFoundError):
                for child in parent.iterdir():
                    if child.is_dir():
                        self.remove(child)
                parent.rmdir()
        if self.registry is not None:
            self.registry.unlink(missing_ok=True)


def _with_reserve(controller: str, limits: Limits) -> Limits:
    if controller == "memory":
        return Limits(limits.memory_bytes + AGENT_MEMORY_RESERVE, limits.cpu_millis, limits.pids)
    return Limits(limits.memory_bytes, limits.cpu_millis, limits.pids + AGENT_PIDS_RESERVE)


_CLOCK_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _proc_cpu_ns(pid: int) -> int:
    """utime+stime+cutime+cstime of ``pid`` in ns; 0 once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # fields after the ")" that closes comm: state is field 3, utime 14 … cstime 17
    fields = raw[raw.rindex(")") + 2 :].split()
    return sum(int(x) for x in fields[11:15]) * _CLOCK_TICK_NS


def _strict_read(path: Path) -> str:
    return path.read_text().strip()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        if not path.parent.exists():
            raise
        return ""


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
