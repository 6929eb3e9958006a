"""Where the machine's CPU went during a benchmark: the whole machine's busy time from
/proc/stat, split by process kind from a /proc sampler.

The machine is shared (other engineers run stacks, test suites and benchmarks on the
same cores), so only this run's processes are charged to a kind:

* the benchmark process itself (its sampler threads are reported apart, they measure
  and do not load the server);
* the web and worker process trees (descendants of the pids passed in ``roots``);
* the worker's short-lived children (``ip``, ``nft``, launchers): charged from the
  pool processes' ``cutime``/``cstime``, which the kernel adds when a child is
  reaped, so even commands no sample saw are counted;
* sandbox agents and bwrap of this instance (their cgroup path names it), with the
  commands an agent reaped;
* Postgres backends connected to this run's database.

Everything else that ran — other people's processes, shared Redis, the kernel's
threads — is "not this run"; what no sample saw and no parent reaped is the
residual. Processes are sampled every ``interval`` seconds; each pid's last seen
counters are kept, so a process that lived through one sample is counted in full.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

_TICK = os.sysconf("SC_CLK_TCK")

CLIENT = "benchmark client (load generator)"
SAMPLERS = "benchmark samplers (measurement)"
WEB = "web (uvicorn)"
WORKER = "celery worker"
WORKER_CHILDREN = "worker's subprocesses (ip, nft, launch)"
AGENTS = "sandbox agents (+ their commands)"
BWRAP = "bwrap (+ pause)"
ZYGOTE = "agent zygote (+ handlers)"
POSTGRES = "postgres (this run's DB)"
REDIS = "redis (shared)"
ELSEWHERE = "not this run (other users, kernel)"
RESIDUAL = "unseen short-lived (machine-wide)"


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


@dataclass
class _Proc:
    kind: str
    ppid: int
    own: int = 0  # utime + stime
    reaped: int = 0  # cutime + cstime


class CpuAccount(threading.Thread):
    def __init__(self, scope: Scope | None = None, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.scope = scope or Scope()
        self.interval = interval
        self.running = True
        self.me = os.getpid()
        self._first: dict[int, _Proc] = {}
        self._last: dict[int, _Proc] = {}
        self._kinds: dict[int, str] = {}
        self._busy_start = _machine_busy_ticks()
        self._wall_start = time.perf_counter()
        self._sample(initial=True)
        self.busy_ticks = 0
        self.wall = 0.0
        self.thread_cpu = 0.0  # this sampler's own CPU, measured in its thread
        self.other_samplers_cpu = 0.0  # set by the caller (e.g. the memory sampler)

    def _classify(self, pid: int, comm: str, ppid: int, stats: dict[int, tuple[str, int]]) -> str:
        if pid == self.me:
            return CLIENT
        scope = self.scope
        if scope.instance:
            try:
                with open(f"/proc/{pid}/cgroup") as f:
                    cgroup = f.read()
            except OSError:
                cgroup = ""
            if f"/hedgerow-{scope.instance}/" in cgroup:
                if comm.startswith("hedgerow-zyg"):  # a launch handler, in its sandbox
                    return ZYGOTE
                return BWRAP if comm in ("bwrap", "pause") else AGENTS
        if comm.startswith("hedgerow-zyg"):
            # The zygote runs detached (reparented away from the worker); on a shared
            # machine another run's zygote would be counted here too.
            return ZYGOTE
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = ""
        if comm.startswith("postgres"):
            if scope.db_name and f" {scope.db_name} " in cmdline:
                return POSTGRES
            return ELSEWHERE
        if comm.startswith("redis"):
            return REDIS
        # Walk up to a root of this run (the parent may not be sampled yet).
        seen, current = 0, pid
        while current > 1 and seen < 64:
            if current in scope.roots:
                kind = scope.roots[current]
                if kind == WORKER and "celery" not in cmdline:
                    return WORKER_CHILDREN
                return kind
            current = stats[current][1] if current in stats else _ppid(current)
            seen += 1
        return ELSEWHERE

    def _sample(self, initial: bool = False) -> None:
        stats: dict[int, tuple[str, int]] = {}
        counters: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2 :].split()
            stats[pid] = (comm, int(fields[1]))
            counters[pid] = (
                int(fields[11]) + int(fields[12]),
                int(fields[13]) + int(fields[14]),
            )
        for pid, (comm, ppid) in stats.items():
            kind = self._kinds.get(pid)
            # A launcher joins its sandbox's cgroup after the fork: look again.
            if kind is None or kind in (WORKER_CHILDREN, ZYGOTE):
                kind = self._kinds[pid] = self._classify(pid, comm, ppid, stats)
            own, reaped = counters[pid]
            proc = _Proc(kind, ppid, own, reaped)
            if initial:
                self._first[pid] = proc
            self._last[pid] = proc

    def run(self) -> None:
        started = time.thread_time()
        while self.running:
            time.sleep(self.interval)
            self._sample()
        self.thread_cpu = time.thread_time() - started

    def stop(self) -> None:
        self.running = False
        self.join()
        self._sample()
        self.busy_ticks = _machine_busy_ticks() - self._busy_start
        self.wall = time.perf_counter() - self._wall_start

    def breakdown(self) -> dict[str, float]:
        """CPU seconds per kind over the run, plus the unsampled residual."""
        by_kind: dict[str, float] = defaultdict(float)
        final = set(os.listdir("/proc"))
        for pid, proc in self._last.items():
            first = self._first.get(pid)
            own = proc.own - (first.own if first else 0)
            reaped = proc.reaped - (first.reaped if first else 0)
            parent = self._last.get(proc.ppid)
            if (
                proc.kind == WORKER_CHILDREN
                and str(pid) not in final
                and parent is not None
                and parent.kind == WORKER
            ):
                continue  # reaped by its pool process: counted in the parent's cutime
            by_kind[proc.kind] += own / _TICK
            if proc.kind == WORKER:
                by_kind[WORKER_CHILDREN] += reaped / _TICK
            elif proc.kind == AGENTS:
                by_kind[AGENTS] += reaped / _TICK
            elif proc.kind == CLIENT:
                by_kind[CLIENT] += reaped / _TICK
        samplers = self.thread_cpu + self.other_samplers_cpu
        by_kind[CLIENT] -= samplers
        by_kind[SAMPLERS] += samplers
        seen = sum(by_kind.values())
        by_kind[RESIDUAL] = max(0.0, self.busy_ticks / _TICK - seen)
        return dict(by_kind)

    def report(self, per: int, unit: str) -> list[str]:
        total = self.busy_ticks / _TICK
        parts = self.breakdown()
        ours = sum(v for k, v in parts.items() if k not in (ELSEWHERE, RESIDUAL, REDIS, SAMPLERS))
        out = [
            f"machine CPU            {total:.1f} s busy in {self.wall:.1f} s wall "
            f"({total / max(self.wall, 1e-9):.2f} of {os.cpu_count()} cores), "
            f"{1e3 * total / max(per, 1):.1f} ms per {unit}",
            f"this run's processes   {ours:.1f} s, {1e3 * ours / max(per, 1):.1f} ms per {unit} "
            "(client + web + worker + its subprocesses + agents + bwrap + postgres)",
        ]
        for kind, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
            out.append(
                f"  {kind:<40} {seconds:7.1f} s  {1e3 * seconds / max(per, 1):7.1f} ms/{unit}"
            )
        return out


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        return int(raw[raw.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0
