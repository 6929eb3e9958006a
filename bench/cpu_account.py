"""Where the machine's CPU went during a benchmark: the whole machine's busy time from
/proc/stat, split by process kind.

The machine is shared (other engineers run stacks, test suites and benchmarks on the
same cores), so only this run's processes are charged to a kind:

* the benchmark process itself (its sampler threads are reported apart, they measure
  and do not load the server);
* the web and worker process trees (descendants of the pids passed in ``roots``); the
  pool processes' ``cutime``/``cstime`` (what the kernel adds when a child is reaped)
  is the worker's short-lived children (``ip``, ``nft``, launchers);
* the instance's agent zygote (``Scope.zygote``): a detached daemon and child subreaper
  of every launch handler, bwrap, pause, agent and command of the instance, so its
  ``cutime``/``cstime`` holds all of them once they are gone;
* Postgres backends connected to this run's database.

**Exact totals from two snapshots.** Every process on the machine is read once before
the clock starts and once after it stops (outside the measured window). A process's
counters are cumulative and, when it is reaped, its parent's ``cutime`` grows by its
whole life, so each tree's CPU in the window is exact: the growth of its live
processes' ``utime+stime+cutime+cstime``, minus the counters at the start of those
alive then and gone at the end (their whole life is now in their reaper's ``cutime``).
Nothing needs to be seen between the two snapshots for the totals.

**The split inside a reaper's ``cutime``** (bwrap vs agents vs handlers inside the
zygote's, ``ip`` vs ``nft`` …) needs the dead processes' last counters: the optional
*light* sampler reads, in the window, only the zygote's and the worker pool's direct
children (``/proc/<pid>/task/<pid>/children`` + ``/proc/<pid>/stat``), at an interval
that keeps its own cost near 2.5 % of one core. What it saw of a process that then died
moves from the reaper's row to the process's kind; what it did not see (a handler that
lived 20 ms, a process's last moments) stays in the reaper's row. With the sampler
*off*, the window has no measurement load at all (the memory sampler aside) and the
zygote's reaped CPU is one row. Postgres backends that connected and disconnected
inside the window are not seen in either mode (the bench's connections are pooled).

Everything else — other people's processes, shared Redis, the kernel's threads — is
"not this run" (counted from the two snapshots the same way); what is left of the
machine's busy time is the residual: processes born and gone inside the window whose
reaper is not alive at the end (or is not in /proc), and kernel time no process owns.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

_TICK = os.sysconf("SC_CLK_TCK")

CLIENT = "benchmark client (load generator)"
SAMPLERS = "benchmark samplers (measurement)"
WEB = "web (uvicorn)"
WORKER = "celery worker"
WORKER_CHILDREN = "worker's subprocesses (ip, nft, launch)"
AGENTS = "sandbox agents (+ their commands)"
BWRAP = "bwrap (+ pause)"
ZYGOTE = "agent zygote (+ launch handlers seen)"
SANDBOX_REAPED = "zygote's reaped, not split (handlers, exits)"
POSTGRES = "postgres (this run's DB)"
REDIS = "redis (shared)"
ELSEWHERE = "not this run (other users, kernel)"
RESIDUAL = "unseen short-lived (machine-wide)"

MODES = ("light", "off")
# kinds that are this run's (for "this run's processes")
NOT_OURS = (ELSEWHERE, RESIDUAL, REDIS, SAMPLERS)


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle


@dataclass
class Scope:
    """What belongs to this run."""

    roots: dict[int, str] = field(default_factory=dict)  # pid -> kind of its tree
    instance: str = ""  # HEDGEROW_INSTANCE: agents' cgroups are hedgerow-<instance>/…
    db_name: str = ""
    # the instance's agent zygote, if it runs (it may start inside the window)
    zygote: Callable[[], int | None] = lambda: None


@dataclass
class _Proc:
    pid: int
    comm: str
    ppid: int
    start: int  # starttime, in ticks since boot: (pid, start) names one process
    own: int = 0  # utime + stime
    reaped: int = 0  # cutime + cstime
    kind: str = ""


def _read(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    close = raw.rindex(b")")
    fields = raw[close + 2 :].split()
    return _Proc(
        pid,
        raw[raw.index(b"(") + 1 : close].decode(errors="replace"),
        int(fields[1]),
        int(fields[19]),
        int(fields[11]) + int(fields[12]),
        int(fields[13]) + int(fields[14]),
    )


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


Key = tuple[int, int]  # (pid, starttime)


class CpuAccount(threading.Thread):
    def __init__(self, scope: Scope | None = None, mode: str = "light") -> None:
        super().__init__(daemon=True)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.scope = scope or Scope()
        self.mode = mode
        self.interval = 0.5  # adapted: see run()
        self.samples = 0
        self.running = True
        self.me = os.getpid()
        self.zygotes: set[int] = set()
        self._kinds: dict[Key, str] = {}
        # A scan of a loaded machine takes a while and every process keeps running
        # meanwhile: the machine's counter is read on both sides, its midpoint used.
        before = _machine_busy_ticks()
        self._start = self._scan()
        self._busy_start = (before + _machine_busy_ticks()) / 2
        self._last: dict[Key, _Proc] = dict(self._start)
        self._end: dict[Key, _Proc] = {}
        self._mark_self(self._start)  # the scan above is outside the window
        self._wall_start = time.perf_counter()
        self.busy_ticks = 0.0
        self.wall = 0.0
        self.thread_cpu = 0.0  # this sampler's own CPU, measured in its thread
        self.other_samplers_cpu = 0.0  # set by the caller (e.g. the memory sampler)

    # -- classification ------------------------------------------------------------------

    def _kind(self, p: _Proc, ppids: dict[int, int]) -> str:
        key = (p.pid, p.start)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = self._classify(p, ppids)
        return kind

    def _classify(self, p: _Proc, ppids: dict[int, int]) -> str:
        scope = self.scope
        if p.pid == self.me:
            return CLIENT
        if p.pid in self.zygotes:
            return ZYGOTE
        if p.pid in scope.roots:
            # before the walk up: a private stack's web and worker are children of this
            # process and would otherwise be counted as the benchmark client
            return scope.roots[p.pid]
        seen, current = 0, p.ppid
        while current > 1 and seen < 64:
            if current in self.zygotes:
                if p.comm.startswith("hedgerow-zyg"):
                    return ZYGOTE  # a launch handler
                return BWRAP if p.comm in ("bwrap", "pause") else AGENTS
            if current in scope.roots:
                kind = scope.roots[current]
                if kind != WORKER or "celery" in _cmdline(p.pid):
                    return kind
                # exec launch: bwrap and agents are the worker's children, in a cgroup
                # of this instance
                try:
                    with open(f"/proc/{p.pid}/cgroup") as f:
                        cgroup = f.read()
                except OSError:
                    cgroup = ""
                if scope.instance and f"/hedgerow-{scope.instance}/" in cgroup:
                    return BWRAP if p.comm in ("bwrap", "pause") else AGENTS
                return WORKER_CHILDREN
            if current == self.me:
                return CLIENT
            current = ppids[current] if current in ppids else _ppid(current)
            seen += 1
        if p.comm.startswith("postgres"):
            if scope.db_name and f" {scope.db_name} " in _cmdline(p.pid):
                return POSTGRES
            return ELSEWHERE
        if p.comm.startswith("redis"):
            return REDIS
        return ELSEWHERE

    def _reaped_kind(self, p: _Proc) -> str:
        """Where a process's ``cutime`` (its reaped children) is charged."""
        if p.kind == ZYGOTE and p.pid in self.zygotes:
            return SANDBOX_REAPED
        if p.kind == WORKER:
            return WORKER_CHILDREN
        return p.kind

    # -- snapshots -----------------------------------------------------------------------

    def _find_zygote(self) -> None:
        try:
            pid = self.scope.zygote()
        except Exception:  # a measurement never breaks the run
            pid = None
        if pid:
            self.zygotes.add(pid)

    def _scan(self) -> dict[Key, _Proc]:
        """Every process on the machine (outside the window only: it is not cheap)."""
        self._find_zygote()
        procs: list[_Proc] = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                p = _read(int(name))
                if p is not None:
                    procs.append(p)
        ppids = {p.pid: p.ppid for p in procs}
        out: dict[Key, _Proc] = {}
        for p in procs:
            p.kind = self._kind(p, ppids)
            out[(p.pid, p.start)] = p
        return out

    def _mark_self(self, snapshot: dict[Key, _Proc]) -> None:
        me = _read(self.me)
        if me is not None:
            me.kind = CLIENT
            snapshot[(me.pid, me.start)] = me

    def _sample(self) -> None:
        """The light sample: the direct children of the zygote and the worker's pool
        (whose ``cutime`` gets them), stat only; a new pid is classified once."""
        parents = list(self.zygotes)
        for pid, kind in self.scope.roots.items():
            if kind == WORKER:
                parents += [pid, *_children(pid)]
        for parent in parents:
            for pid in _children(parent):
                p = _read(pid)
                if p is None:
                    continue
                p.kind = self._kind(p, {})
                self._last[(p.pid, p.start)] = p

    def run(self) -> None:
        started = time.thread_time()
        if self.mode == "light":
            while self.running:
                time.sleep(self.interval)
                if not self.running:
                    break
                if not self.zygotes:
                    self._find_zygote()
                t0 = time.thread_time()
                self._sample()
                self.samples += 1
                # ~2.5 % of one core at most: 1000 live sandboxes are 2000 children
                self.interval = min(5.0, max(0.5, 40 * (time.thread_time() - t0)))
        self.thread_cpu = time.thread_time() - started

    def stop(self) -> None:
        self.running = False
        self.join()
        self.wall = time.perf_counter() - self._wall_start
        self._end = {}
        self._mark_self(self._end)  # before the scan, which is outside the window
        me = dict(self._end)
        before = _machine_busy_ticks()
        self._end = self._scan()
        self.busy_ticks = (before + _machine_busy_ticks()) / 2 - self._busy_start
        self._end.update(me)
        self._last.update(self._end)

    # -- the figures ---------------------------------------------------------------------

    def _reaper(self, p: _Proc, by_pid: dict[int, _Proc]) -> _Proc | None:
        """The nearest ancestor alive at the end: its ``cutime`` holds ``p``'s life.
        The zygote is subreaper of its tree: orphans of dead handlers go to it."""
        current, seen = p.ppid, 0
        while current > 0 and seen < 64:
            parent = by_pid.get(current)
            if parent is None or parent.start > p.start:
                return None
            if (parent.pid, parent.start) in self._end:
                return parent
            if p.kind in (BWRAP, AGENTS, ZYGOTE):
                for z in self.zygotes:
                    zp = by_pid.get(z)
                    if zp is not None and (zp.pid, zp.start) in self._end:
                        return zp
            current, seen = parent.ppid, seen + 1
        return None

    @property
    def busy_s(self) -> float:
        """The machine's busy CPU seconds in the window (all cores, every process)."""
        return self.busy_ticks / _TICK

    def breakdown(self) -> dict[str, float]:
        """CPU seconds per kind over the run, plus the residual."""
        ticks: dict[str, int] = defaultdict(int)
        by_pid: dict[int, _Proc] = {}
        for p in sorted(self._last.values(), key=lambda q: q.start):
            by_pid[p.pid] = p  # the latest process of that pid
        for key, p in self._last.items():
            first = self._start.get(key)
            own0, reaped0 = (first.own, first.reaped) if first else (0, 0)
            ticks[p.kind] += p.own - own0
            ticks[self._reaped_kind(p)] += p.reaped - reaped0
            if key not in self._end:  # gone: its whole life is in its reaper's cutime
                reaper = self._reaper(p, by_pid)
                if reaper is not None:
                    ticks[self._reaped_kind(reaper)] -= p.own + p.reaped
        by_kind = {k: v / _TICK for k, v in ticks.items() if v}
        samplers = self.thread_cpu + self.other_samplers_cpu
        by_kind[CLIENT] = by_kind.get(CLIENT, 0.0) - samplers
        by_kind[SAMPLERS] = samplers
        seen = sum(by_kind.values())
        by_kind[RESIDUAL] = self.busy_ticks / _TICK - seen  # may be < 0 by a few ticks
        return by_kind

    def describe(self) -> str:
        if self.mode == "off":
            return (
                "CPU accounting: sampler off (two /proc snapshots outside the window; "
                "the zygote's reaped CPU is not split)"
            )
        return (
            f"CPU accounting: light sampler ({self.samples} samples of the zygote's and "
            f"worker pool's children, last interval {self.interval:.2f} s) + two /proc "
            "snapshots outside the window"
        )

    def report(self, per: int, unit: str) -> list[str]:
        total = self.busy_ticks / _TICK
        parts = self.breakdown()
        ours = sum(v for k, v in parts.items() if k not in NOT_OURS)
        out = [
            self.describe(),
            f"machine CPU            {total:.1f} s busy in {self.wall:.1f} s wall "
            f"({total / max(self.wall, 1e-9):.2f} of {os.cpu_count()} cores), "
            f"{1e3 * total / max(per, 1):.1f} ms per {unit}",
            f"this run's processes   {ours:.1f} s, {1e3 * ours / max(per, 1):.1f} ms per {unit} "
            "(client + web + worker + its subprocesses + zygote and sandboxes + postgres)",
        ]
        for kind, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
            out.append(
                f"  {kind:<40} {seconds:7.1f} s  {1e3 * seconds / max(per, 1):7.1f} ms/{unit}"
            )
        return out


def _ppid(pid: int) -> int:
    p = _read(pid)
    return p.ppid if p is not None else 0
