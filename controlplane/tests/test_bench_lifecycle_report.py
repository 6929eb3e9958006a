"""bench/lifecycle.py's stress report (issue 17 goal 5: QPS, p50/p99 per operation
kind, validity rate η, CPU per valid lifecycle) and its ready curve (a PNG)."""

from __future__ import annotations

import struct
from pathlib import Path

from bench.lifecycle import Results, ready_curve, stress_report, write_ready_curve


def _results() -> Results:
    r = Results()
    # 4 lifecycles started at t=100 s, 3 valid; one failed after its create
    r.creates = [0.010, 0.020, 0.030, 0.040]
    r.waits = [1.0, 2.0, 3.0]
    r.execs = [0.005] * 12
    r.deletes = [0.002, 0.004, 0.006]
    r.ready = [1.01, 2.02, 3.03]
    r.ready_at = [103.03, 101.01, 102.02]
    r.deleted_at = [101.5, 102.5, 103.5]
    r.requests = 4 + 3 + 12 + 3 + 1  # one retried create
    r.ok = 3
    return r


def test_the_stress_report_gives_rate_validity_cost_and_each_kinds_percentiles() -> None:
    lines = stress_report(_results(), wall=2.3, machine_cpu_s=0.6, stack_cpu_s=0.3, n=4)
    head = lines[0]
    assert "10.0 requests/s answered (23 in 2.30 s)" in head
    assert "η = 0.750 (3/4 valid)" in head
    assert "per valid lifecycle 200.0 ms of machine CPU, 100.0 ms of this stack's" in head
    rows = {row.split()[0]: row.split() for row in lines[1:]}
    assert set(rows) == {"create", "wait", "exec", "delete"}
    assert rows["create"][1] == "4" and rows["exec"][1] == "12"
    assert rows["wait"][rows["wait"].index("p50") + 1] == "2000.0"
    assert rows["delete"][rows["delete"].index("p99") + 1] == "6.0"


def test_no_valid_lifecycle_is_said_rather_than_divided_by() -> None:
    empty = Results()
    assert stress_report(empty, wall=1.0, machine_cpu_s=1.0, stack_cpu_s=1.0, n=5)[0].endswith(
        "η = 0.000 (0/5 valid), no valid lifecycle"
    )


def test_the_ready_curve_is_in_time_order_from_the_first_create(tmp_path: Path) -> None:
    ready, deleted = ready_curve(_results(), started=100.0)
    assert [round(t, 2) for t in ready] == [1.01, 2.02, 3.03]
    assert [round(t, 2) for t in deleted] == [1.5, 2.5, 3.5]
    png = tmp_path / "figures" / "ready.png"
    write_ready_curve(png, _results(), 100.0, title="test")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert (width, height) == (800, 450)
