"""REST exec, this tree against another, on one stack: same database, Redis, Celery
worker and sandbox, two web servers sampled interleaved with the direct agent call.

    git archive <commit> | tar -x -C /tmp/base && ln -s "$PWD/.venv" /tmp/base/.venv
    .venv/bin/python -m bench.exec_ab /tmp/base [--n 400] [--seconds 4]

On 2 shared cores the load drifts by the second; two benchmark runs minutes apart do
not compare, samples taken in turn within one run do. Prints p50s, each web server's
c/b, how many reads right after an answer still saw the row running (0 unless a change
answers before storing the result), and per server exec/s with its CPU per exec at 1
and 16 clients.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from bench._stack import make_up_settings, private_stack, set_arg
from bench.exec_latency import (
    Http,
    cpu_per_exec,
    ready_host_sandbox,
    summary,
    timed_interleaved,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("other", type=Path, help="a checkout of the code to compare with")
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reads", type=int, default=200, help="read-after-answer checks")
    parser.add_argument(
        "--web-workers", type=int, default=int(make_up_settings()["HEDGEROW_WEB_WORKERS"])
    )
    args = parser.parse_args()

    def configure(stack: Any) -> None:
        set_arg(stack.web.args, "--workers", str(args.web_workers))  # else as make up

    with private_stack("ab", {}, configure) as (stack, secret):
        port = _free_port()
        other_args = [a if a != str(stack.port) else str(port) for a in stack.web.args]
        log = open(stack.log_dir / "other-web.log", "ab")  # noqa: SIM115 - the child's
        other = subprocess.Popen(
            other_args, cwd=args.other, env=stack.web.env, stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip
        try:
            run(args, stack, secret, port, other.pid)
        finally:
            os.killpg(other.pid, 15)
            other.wait()
    return 0


def run(args: argparse.Namespace, stack: Any, secret: str, other_port: int, other: int) -> None:
    from apps.sandboxes.services.operations import agent_for

    auth = {"Authorization": f"Bearer {secret}"}
    api = Http("127.0.0.1", stack.port, auth)
    sandbox_id, row = ready_host_sandbox(api, auth)
    agent_headers = dict(agent_for(row).headers)
    direct = Http(row.endpoint_host, int(row.endpoint_port or 0), agent_headers)

    def direct_call() -> None:
        body = {"operation_id": uuid.uuid4().hex, "command": "echo hi", "timeout": 30}
        assert direct.post("/exec", body)[0] == 200

    def rest(port: int) -> Any:
        def make() -> Any:
            conn = Http("127.0.0.1", port, auth)
            path = f"/api/v1/sandboxes/{sandbox_id}/exec"

            def call() -> None:
                status, body = conn.post(path, {"command": "echo hi", "timeout": 30})
                assert status == 200 and body["exit_code"] == 0, body

            return call

        return make

    # The other server answers only once it is up: wait for it with real execs.
    for _ in range(600):
        try:
            rest(other_port)()()
            break
        except OSError:
            time.sleep(0.1)
    paths = {"b direct": direct_call, "c this": rest(stack.port)(), "c other": rest(other_port)()}
    load = os.getloadavg()[0]
    results = {k: summary(v) for k, v in timed_interleaved(args.n, paths, warmup=50).items()}
    b = results["b direct"]["p50"]
    print(f"\nn={args.n} interleaved, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| path | p50 ms | p95 ms | p50 / b p50 | p50 − b p50 |\n|---|---:|---:|---:|---:|")
    for name, s in results.items():
        ratio, gap = s["p50"] / b, s["p50"] - b
        print(f"| {name} | {s['p50']:.2f} | {s['p95']:.2f} | {ratio:.2f} | {gap:.2f} |")
    assert stack.web.popen is not None
    servers = {"this": (stack.port, stack.web.popen.pid), "other": (other_port, other)}
    print("\n| server | reads right after the answer that saw the row still running |")
    print("|---|---:|")
    for name, (port, _pid) in servers.items():
        stale, n = read_after_answer(port, auth, sandbox_id, args.reads)
        print(f"| {name} | {stale} of {n} |")
    print("\n| clients | server | exec/s | web CPU ms/exec | Postgres CPU ms/exec | load |")
    print("|---:|---|---:|---:|---:|---:|")
    for clients in (1, 16):
        for _round in range(2):
            for name, (port, pid) in servers.items():
                load = os.getloadavg()[0]
                rate, web_ms, pg_ms = cpu_per_exec(rest(port), clients, args.seconds, pid)
                print(
                    f"| {clients} | {name} | {rate:.0f} | {web_ms:.2f} | {pg_ms:.2f} | {load:.1f} |"
                )


def read_after_answer(port: int, auth: dict[str, str], sandbox_id: str, n: int) -> tuple[int, int]:
    """(reads that saw ``running``, n): each exec's row read at once through the ORM
    after its answer. The answer is the record (test_exec_read_after_answer_live.py):
    anything but 0 means a change answers before the result is stored."""
    from apps.sandboxes.models import Operation

    conn = Http("127.0.0.1", port, auth)
    path = f"/api/v1/sandboxes/{sandbox_id}/exec"
    stale = 0
    for _ in range(n):
        operation_id = f"op-read-{uuid.uuid4().hex}"
        status, body = conn.post(path, {"command": "true", "operation_id": operation_id})
        assert status == 200, body
        row = Operation.objects.values_list("status", flat=True).get(operation_id=operation_id)
        stale += row == "running"
    return stale, n


if __name__ == "__main__":
    raise SystemExit(main())
