"""Where the machine's CPU went during a benchmark: the whole machine's busy time from
/proc/stat, split by process kind from a /proc sampler.

Processes are sampled every ``interval`` seconds; each pid's last seen utime+stime is
kept, so a process that lived through at least one sample is counted in full (a
sandbox agent, bwrap, a Postgres backend). What no sample saw — short-lived commands
such as ``ip`` and ``nft`` — is the residual, "short-lived processes".
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

_TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle


def _kind(comm: str, cmdline: str) -> str:
    if comm.startswith("hedgerow-zyg"):  # the agent zygote and its per-launch handlers
        return "agent zygote (+ handlers)"
    if "podagent" in cmdline or "hedgerow_launcher" in cmdline or "hedgerow-agent" in comm:
        return "sandbox agents"
    if comm in ("bwrap", "pause"):
        return "bwrap"
    if comm.startswith("postgres") or comm.startswith("postmaster"):
        return "postgres"
    if comm.startswith("redis"):
        return "redis"
    if "uvicorn" in cmdline or "multiprocessing.spawn" in cmdline:  # uvicorn --workers
        return "web (uvicorn)"
    if "celery" in cmdline:
        return "celery worker"
    if "bench." in cmdline:
        return "benchmark client"
    return "other"


class CpuAccount(threading.Thread):
    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.running = True
        self._first: dict[int, int] = {}
        self._last: dict[int, tuple[str, int]] = {}
        self._busy_start = _machine_busy_ticks()
        self._wall_start = time.perf_counter()
        self._sample(initial=True)
        self.busy_ticks = 0
        self.wall = 0.0

    def _sample(self, initial: bool = False) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    raw = f.read()
                comm = raw[raw.index("(") + 1 : raw.rindex(")")]
                fields = raw[raw.rindex(")") + 2 :].split()
                ticks = int(fields[11]) + int(fields[12])
                if pid not in self._last:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                    kind = _kind(comm, cmdline)
                elif comm == "hedgerow-agent":  # a zygote fork became an agent
                    kind = "sandbox agents"
                else:
                    kind = self._last[pid][0]
            except (OSError, ValueError):
                continue
            if initial:
                self._first[pid] = ticks
            self._last[pid] = (kind, ticks)

    def run(self) -> None:
        while self.running:
            time.sleep(self.interval)
            self._sample()

    def stop(self) -> None:
        self.running = False
        self.join()
        self._sample()
        self.busy_ticks = _machine_busy_ticks() - self._busy_start
        self.wall = time.perf_counter() - self._wall_start

    def breakdown(self) -> dict[str, float]:
        """CPU seconds per kind over the run, plus the unsampled residual."""
        by_kind: dict[str, float] = defaultdict(float)
        for pid, (kind, ticks) in self._last.items():
            by_kind[kind] += (ticks - self._first.get(pid, 0)) / _TICK
        seen = sum(by_kind.values())
        by_kind["short-lived processes (residual)"] = max(0.0, self.busy_ticks / _TICK - seen)
        return dict(by_kind)

    def report(self, per: int, unit: str) -> list[str]:
        total = self.busy_ticks / _TICK
        out = [
            f"machine CPU            {total:.1f} s busy in {self.wall:.1f} s wall "
            f"({total / max(self.wall, 1e-9):.2f} of {os.cpu_count()} cores), "
            f"{1e3 * total / max(per, 1):.1f} ms per {unit}"
        ]
        for kind, seconds in sorted(self.breakdown().items(), key=lambda kv: -kv[1]):
            out.append(
                f"  {kind:<34} {seconds:7.1f} s  {1e3 * seconds / max(per, 1):7.1f} ms/{unit}"
            )
        return out
