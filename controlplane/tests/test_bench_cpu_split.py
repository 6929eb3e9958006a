"""bench/cpu_split.py: a thread's CPU between two snapshots lands on its row (its
process's role and its own nice), and children reaped in the window on their
parent's "children reaped" row, without what they had used before the window."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cpu_split import rows_between, snapshot

# Burns a fixed amount of work at nice 7, says so, then waits for its stdin to close
# (the pipe is the synchronisation: no sleeps).
_BURNER = """
import os, sys
os.nice(7)
total = 0
for i in range(3_000_000):
    total += i * i
print("burnt", flush=True)
sys.stdin.read()
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_threads_cpu_in_the_window_is_on_its_process_and_nice_row() -> None:
    before = snapshot()
    burner = subprocess.Popen(
        [sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert burner.stdout is not None and burner.stdout.readline() == b"burnt\n"
        used = _cpu_s(burner.pid)
        rows = rows_between(before, snapshot())
    finally:
        burner.communicate(timeout=60)
    niced = {name: cpu for name, cpu in rows.items() if name.endswith(" nice 7")}
    assert used > 0.0
    # its own row (nothing else on the machine runs at nice 7 from this checkout)
    mine = [cpu for name, cpu in niced.items() if "-c" in name or "python" in name]
    assert mine and max(mine) >= used - 0.02, rows


def test_children_reaped_in_the_window_count_only_their_time_in_the_window() -> None:
    web, agent = ("web (uvicorn)", "", 0), ("hedgerow-agent", "", 0)
    xfer = ("hedgerow-agent", "xfer", 10)
    first = (
        {(10, 10): (web, 5.0), (20, 20): (agent, 1.0)},
        # pid: (comm, cutime+cstime, ppid, own + reaped total)
        {10: ("web (uvicorn)", 0.0, 1, 5.0), 20: ("hedgerow-agent", 2.0, 1, 3.0),
         21: ("sh", 0.0, 20, 0.4), 30: ("bash", 1.0, 1, 1.5)},
    )  # fmt: skip
    second = (
        # a thread born in the window (a transfer's, at nice 10) counts whole
        {(10, 10): (web, 6.5), (20, 20): (agent, 1.2), (20, 22): (xfer, 0.3)},
        # 21 (alive at the start with 0.4 s, 0.5 s at its end) and a child born and
        # reaped in the window (0.1 s) are in the agent's cutime: 2.0 + 0.5 + 0.1;
        # pid 30 is another program now (a reused pid): not charged; 40 was born in
        # the window: its reaped children are not told apart, not charged
        {10: ("web (uvicorn)", 0.0, 1, 6.5), 20: ("hedgerow-agent", 2.6, 1, 3.8),
         30: ("python", 9.0, 1, 9.0), 40: ("make", 4.0, 1, 4.0)},
    )  # fmt: skip
    rows = rows_between(first, second)
    assert rows.keys() == {
        "web (uvicorn) nice 0",
        "hedgerow-agent nice 0",
        "hedgerow-agent/xfer nice 10",
        "hedgerow-agent: children reaped",
    }
    assert rows["web (uvicorn) nice 0"] == pytest.approx(1.5)
    assert rows["hedgerow-agent nice 0"] == pytest.approx(0.2)
    assert rows["hedgerow-agent/xfer nice 10"] == pytest.approx(0.3)
    # 0.1 of pid 21 in the window + 0.1 of the child born in it, not 21's earlier 0.4
    assert rows["hedgerow-agent: children reaped"] == pytest.approx(0.2)
