"""The whole machine's CPU over a window, split per thread: who took the cores while a
benchmark ran (issue 17 goal 4: what a short exec waits behind in the run queue).

    .venv/bin/python -m bench.cpu_split --seconds 20 [--after-line FILE:TEXT] [--top 25]

Two snapshots of every thread on the machine (``/proc/<pid>/task/<tid>/stat``:
utime+stime, nice) ``--seconds`` apart, and of ``/proc/stat``. Each thread's growth
is charged to a row named by its process's command name, its own name when different,
and its nice value (a niced transfer thread of an agent is its own row); a live
process's ``cutime+cstime`` growth (children reaped in the window: an agent's
commands, a worker's ``ip``/``nft``) is a row of its own. What no live thread owns
(processes born and gone in the window whose reaper is gone too, interrupts the
kernel charged to nobody) is the residual against ``/proc/stat``.

``--after-line FILE:TEXT`` waits until FILE has a line containing TEXT first (e.g. a
``bench.mixed`` log's ``idle, 8 clients`` line: its mixed phase starts next).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")

Key = tuple[str, str, int]  # process comm, thread comm ("" when the same), nice


def machine_busy_s() -> float:
    cols = [int(c) for c in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(cols[:8]) - cols[3] - cols[4]) / _TICK


def _stat(path: str) -> tuple[str, list[str]] | None:
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    head, _, rest = raw.rpartition(")")
    return head.partition("(")[2], rest.split()


_ROLES = (
    ("uvicorn", "web (uvicorn)"),
    ("controlplane.serve", "web (uvicorn)"),
    ("celery", "celery worker"),
    ("bench.mixed", "bench.mixed"),
    ("pytest", "pytest (other sessions)"),
    ("bench.", "other bench"),
)


def _python_role(pid: int, comm: str) -> str:
    """A Python process named by what it runs (its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return comm
    if "multiprocessing.spawn" in argv or "multiprocessing.forkserver" in argv:
        # a spawned child: named by its parent (uvicorn's workers, bench's clients)
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            parent = _python_role(ppid, comm)
        except (OSError, ValueError, IndexError):
            parent = comm
        return parent if parent.startswith("web (uvicorn)") else f"{parent}: spawned child"
    # whose: the checkout the interpreter runs from (another session's stack is its own row)
    exe = argv.split(" ", 1)[0]
    tag = f" [{exe.split('/.venv/')[0].rsplit('/', 1)[-1]}]" if "/.venv/" in exe else ""
    for needle, role in _ROLES:
        if needle in argv:
            return role + tag
    return f"{comm} ({argv[:40].strip()})"


Proc = tuple[str, float, int, float]  # comm, cutime+cstime, ppid, own+reaped total
Snapshot = tuple[dict[tuple[int, int], tuple[Key, float]], dict[int, Proc]]


def _instance(pid: int) -> str:
    """`` [<instance>]``: the stack a sandbox process belongs to (its cpu cgroup's
    ``hedgerow-<instance>``), so another session's agents are rows of their own."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if line.split(":")[1] in ("cpu", "cpu,cpuacct"):
                group = line.split(":", 2)[2].strip("/").split("/")[0]
                return f" [{group}]" if group else ""
    except (OSError, IndexError):
        pass
    return ""


def snapshot() -> Snapshot:
    """(thread → (row, utime+stime s), process → (comm, cutime+cstime s, ppid, total))."""
    threads: dict[tuple[int, int], tuple[Key, float]] = {}
    reaped: dict[int, Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        top = _stat(f"/proc/{pid}/stat")
        if top is None:
            continue
        comm, fields = top
        if comm.startswith("python"):
            comm = _python_role(pid, comm)
        elif comm.startswith("hedgerow-"):
            comm += _instance(pid)
        # fields[0] is field 3 (state): utime 14, stime 15, cutime 16, cstime 17, nice 19
        cut = (int(fields[13]) + int(fields[14])) / _TICK
        own = (int(fields[11]) + int(fields[12])) / _TICK
        reaped[pid] = (comm, cut, int(fields[1]), own + cut)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid_name in tids:
            one = _stat(f"/proc/{pid}/task/{tid_name}/stat")
            if one is None:
                continue
            tcomm, tf = one
            key = (comm, "" if tcomm == comm else tcomm, int(tf[16]))
            threads[(pid, int(tid_name))] = (key, (int(tf[11]) + int(tf[12])) / _TICK)
    return threads, reaped


def split(seconds: float) -> tuple[float, float, dict[str, float]]:
    """(window s, machine busy s, row → CPU s)."""
    busy0, t0 = machine_busy_s(), time.monotonic()
    first = snapshot()
    time.sleep(seconds)  # the measured window (bench/, not a test)
    second = snapshot()
    busy1, t1 = machine_busy_s(), time.monotonic()
    return t1 - t0, busy1 - busy0, rows_between(first, second)


def rows_between(first: Snapshot, second: Snapshot) -> dict[str, float]:
    """Row → CPU seconds used between two snapshots."""
    (threads0, reaped0), (threads1, reaped1) = first, second
    rows: dict[str, float] = defaultdict(float)
    for ident, (key, cpu) in threads1.items():
        before = threads0.get(ident)
        grown = cpu - before[1] if before is not None else cpu
        comm, tcomm, nice = key
        rows[f"{comm}{'/' + tcomm if tcomm else ''} nice {nice}"] += grown
    # a process alive at the start and reaped in the window: its whole life lands in
    # its parent's cutime; what it had used before the window is taken off again
    earlier: dict[int, float] = defaultdict(float)
    for pid, (_comm, _cut, ppid, total) in reaped0.items():
        if pid not in reaped1:
            earlier[ppid] += total
    for pid, (comm, cpu, _ppid, _total) in reaped1.items():
        before_r = reaped0.get(pid)
        # a process born in the window: its reaped children are counted in their own
        # rows only if they were live at the end (a fork's counters start at zero, but
        # a pid seen only once cannot be told from a reused one)
        grown = (
            cpu - before_r[1] - earlier[pid]
            if before_r is not None and before_r[0] == comm
            else 0.0
        )
        if grown > 0:
            rows[f"{comm}: children reaped"] += grown
    return dict(rows)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--after-line", default="")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.after_line:
        name, _, text = args.after_line.partition(":")
        while not any(text in line for line in Path(name).read_text().splitlines()):
            time.sleep(0.5)  # polling a log file for the phase to start
    load = Path("/proc/loadavg").read_text().split()[0]
    wall, busy, rows = split(args.seconds)
    owned = sum(rows.values())
    print(
        f"window {wall:.1f} s, load at start {load}: machine busy {busy:.2f} s "
        f"({100 * busy / wall:.0f} % of one core); per thread (% of one core):"
    )
    for name, cpu in sorted(rows.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {100 * cpu / wall:6.1f} %  {name}")
    print(f"  {100 * (busy - owned) / wall:6.1f} %  residual (no live thread owns it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
