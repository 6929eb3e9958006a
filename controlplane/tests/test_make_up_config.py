"""The published numbers are the user's numbers (issue 17 goal 2): `make up`
(scripts/stack.sh) and every benchmark's private stack (bench/_stack.py) read their
configuration from one file, scripts/stack-defaults.env, and a benchmark prints the
configuration it measured, naming every deviation from `make up`'s."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from bench._stack import describe, make_up, make_up_settings, set_arg
from bench.lifecycle import _prefix_for
from conftest import Stack

ROOT = Path(__file__).resolve().parents[2]


def _stack_sh_config(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in make_up_settings()}
    out = subprocess.run(
        [str(ROOT / "scripts" / "stack.sh"), "config"],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return dict(row.split("=", 1) for row in out.split())


def test_make_up_and_the_benchmarks_read_the_same_configuration() -> None:
    settings = make_up_settings()
    assert set(settings) >= {
        "HEDGEROW_WEB_WORKERS",
        "HEDGEROW_DB_POOL_MAX",
        "HEDGEROW_KEEP_ALIVE_S",
        "HEDGEROW_WORKER_CONCURRENCY",
        "HEDGEROW_LOCAL_SUBNET_PREFIX",
    }
    assert _stack_sh_config() == settings
    # an operator's environment variable wins for `make up`, one setting at a time
    changed = _stack_sh_config(HEDGEROW_WORKER_CONCURRENCY="7")
    assert changed == {**settings, "HEDGEROW_WORKER_CONCURRENCY": "7"}


def _stack() -> Stack:
    stack = Stack("hr_unused", Path(tempfile.mkdtemp(prefix="hr-cfg-")))
    # private_stack sets the subnet's size in the environment the processes inherit
    stack.env["HEDGEROW_LOCAL_SUBNET_PREFIX"] = make_up_settings()["HEDGEROW_LOCAL_SUBNET_PREFIX"]
    # ... and the agents' interpreter setting (auto)
    stack.env["HEDGEROW_LOCAL_ZYGOTE_PYTHON"] = make_up_settings()["HEDGEROW_LOCAL_ZYGOTE_PYTHON"]
    stack.env.pop("HEDGEROW_MAX_LIVE_SANDBOXES", None)
    stack.env.pop("HEDGEROW_WARM_POOL", None)
    return stack


def test_a_benchmark_stack_runs_as_make_up_and_says_so() -> None:
    settings = make_up_settings()
    stack = _stack()
    make_up(stack)
    args = stack.web.args
    assert args[args.index("--workers") + 1] == settings["HEDGEROW_WEB_WORKERS"]
    assert args[args.index("--loop") + 1] == "uvloop"
    assert args[args.index("--http") + 1] == "httptools"
    assert stack.web.env["HEDGEROW_DB_POOL"] == "1"
    assert stack.web.env["HEDGEROW_DB_POOL_MAX"] == settings["HEDGEROW_DB_POOL_MAX"]
    worker = stack.worker.args
    assert worker[worker.index("-c") + 1] == settings["HEDGEROW_WORKER_CONCURRENCY"]
    line = describe(stack)
    assert line.startswith("configuration: web workers 2,") and line.endswith("as make up")
    assert f"Celery worker -c {settings['HEDGEROW_WORKER_CONCURRENCY']}" in line


def test_a_deviation_from_make_up_is_named_on_the_configuration_line() -> None:
    stack = _stack()
    make_up(stack)
    set_arg(stack.worker.args, "-c", "8")
    stack.web.args += ["--workers", "3"]  # appended again: the last value is the one run
    line = describe(stack)
    assert "DIFFERS from make up" in line
    assert "Celery worker -c 8 (make up: 4)" in line and "web workers 3 (make up: 2)" in line
    assert stack.worker.args.count("-c") == 1


def test_the_lifecycle_bench_takes_make_ups_subnet_unless_the_run_needs_more() -> None:
    prefix = int(make_up_settings()["HEDGEROW_LOCAL_SUBNET_PREFIX"])
    assert _prefix_for(200, prefix) == prefix
    assert _prefix_for(1000, prefix) == 21  # 2045 addresses hold 1000 with room
    assert _prefix_for(2000, prefix) == 20


def test_a_smaller_subnet_is_named_as_a_deviation() -> None:
    stack = _stack()
    make_up(stack)
    stack.worker.env = {**stack.worker.env, "HEDGEROW_LOCAL_SUBNET": "10.214.8.0/23"}
    line = describe(stack)
    assert "subnet /23 (10.214.8.0/23) (make up: /21)" in line
