"""The v1 CPU figure (cgroups.py ``_proc_cpu_ns``): a task's utime+stime+cutime+cstime
from /proc, in ns; it grows with work and is 0 for a task that is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from apps.sandboxes.backends.local.cgroups import _proc_cpu_ns


def test_it_counts_own_work_and_waited_children() -> None:
    before = _proc_cpu_ns(os.getpid())
    # a child that works and is waited for: counted in our cutime
    subprocess.run([sys.executable, "-c", "sum(range(2 * 10**7))"], check=True)
    after = _proc_cpu_ns(os.getpid())
    assert after - before >= 50_000_000, (before, after)


def test_a_gone_task_counts_nothing() -> None:
    gone = subprocess.Popen(["true"])
    assert gone.wait() == 0  # reaped: its /proc entry is gone
    assert _proc_cpu_ns(gone.pid) == 0
