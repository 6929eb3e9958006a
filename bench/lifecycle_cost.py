"""What one sandbox lifecycle costs the control plane, step by step: CPU of the web
process per request (create, wait, exec, delete), CPU of the Celery worker per
provision and per destroy (its ip/nft children included), and the SQL statements each
step sends, by process.

    .venv/bin/python -m bench.lifecycle_cost [N] [K] [--concurrency C] [--statements]

Boots a private stack (one uvicorn worker, so one process to measure), then runs the
phases one after another over N sandboxes, C requests in flight: N creates; N waits
(until every sandbox is ready — the worker's provisioning CPU is measured from the
first create to the last ready); two baselines, N × GET /healthz (Django's middleware
alone) and N × GET /sandboxes/<id> (a DRF read of one row); N×K execs; N deletes
(worker CPU until every sandbox is deleted). A sandbox that failed to start is
reported and skipped by the steps that need it ready. With ``--statements`` the
private database logs every statement (``ALTER DATABASE … SET log_statement = 'all'``,
on this run's database only) and the server log is read back: statements per step,
per process (web / worker, told apart by
``application_name``) and the most frequent statement shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._http import Client
from bench._stack import make_up_settings, private_stack, set_arg

_TICK = os.sysconf("SC_CLK_TCK")
PG_LOG = Path(os.environ.get("HEDGEROW_BENCH_PG_LOG", "/work/main/.state/postgres/server.log"))
_LINE = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] (?:LOG|ERROR):  (.*)$")


def tree_ticks(root: int) -> tuple[int, int]:
    """(utime+stime of a process tree, cutime+cstime: the children it reaped — for the
    worker, its ip/nft/launch commands)."""
    own = reaped = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
            fields = raw[raw.rindex(")") + 2 :].split()
            own += int(fields[11]) + int(fields[12])
            reaped += int(fields[13]) + int(fields[14])
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return own, reaped


def own_ticks(pid: int) -> int:
    """utime+stime of one process: the Celery worker's main process (the consumer that
    receives, acks and hands tasks to the pool), apart from its pool."""
    from bench.exec_latency import _ticks

    return _ticks(pid)


class Statements:
    """Reads this run's statements back from the Postgres server log."""

    def __init__(self, db_name: str) -> None:
        self.db_name = db_name
        self.offset = PG_LOG.stat().st_size if PG_LOG.exists() else 0
        self.roles: dict[str, str] = {}
        self.running = True
        threading.Thread(target=self._watch_backends, daemon=True).start()

    def _watch_backends(self) -> None:
        """Which backend pid serves which process (log_connections cannot be set per
        database, so pg_stat_activity is polled)."""
        import psycopg

        from apps.core.env import db_conninfo

        with psycopg.connect(db_conninfo("postgres"), autocommit=True) as conn:
            while self.running:
                for pid, app in conn.execute(
                    "SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s",
                    [self.db_name],
                ):
                    self.roles[str(pid)] = app or "?"
                time.sleep(0.1)

    def take(self) -> tuple[Counter[str], Counter[tuple[str, str]]]:
        """(statements per role, per (role, shape)) since the last call."""
        per_role: Counter[str] = Counter()
        shapes: Counter[tuple[str, str]] = Counter()
        with open(PG_LOG, errors="replace") as f:
            f.seek(self.offset)
            data = f.read()
            self.offset = f.tell()
        for row in data.splitlines():
            m = _LINE.match(row)
            if not m:
                continue
            pid, text = m.groups()
            role = self.roles.get(pid)
            if role is None:
                continue
            if text.startswith("statement: ") or text.startswith("execute "):
                sql = text.split(": ", 1)[1] if ": " in text else text
                per_role[role] += 1
                shapes[(role, _shape(sql))] += 1
        return per_role, shapes


def _shape(sql: str) -> str:
    sql = re.sub(r"'[^']*'", "?", sql)
    sql = re.sub(r"\$\d+|\b\d+\b", "?", sql)
    return re.sub(r"\s+", " ", sql)[:150]


def _spy_start(step: str, web: int, worker: int, out: str) -> list[subprocess.Popen[bytes]]:
    """py-spy (collapsed stacks, 250 Hz, threads holding the GIL) on every Python
    process of both trees."""
    Path(out).mkdir(parents=True, exist_ok=True)
    spies = []
    for role, root in (("web", web), ("worker", worker)):
        for pid in _tree(root):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"python" not in cmdline or b"resource_tracker" in cmdline:
                continue  # ip/nft children; uvicorn's resource tracker
            spies.append(
                subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "py-spy"),
                        "record",
                        "-p",
                        str(pid),
                        "-r",
                        "250",
                        "-f",
                        "raw",
                        "--nonblocking",
                        "-o",
                        f"{out}/{step}-{role}-{pid}.txt",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    time.sleep(0.5)
    return spies


def _tree(root: int) -> list[int]:
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


async def _many(n: int, concurrency: int, step: Callable[[int], Awaitable[None]]) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await step(i)

    await asyncio.gather(*(one(i) for i in range(n)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=50)
    parser.add_argument("k", type=int, nargs="?", default=4)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument(
        "--worker-concurrency",
        type=int,
        default=int(make_up_settings()["HEDGEROW_WORKER_CONCURRENCY"]),
        help="default: make up's (scripts/stack-defaults.env)",
    )
    parser.add_argument(
        "--worker-pool", default="prefork", help="Celery pool (-P): prefork, threads, solo"
    )
    parser.add_argument("--statements", action="store_true")
    parser.add_argument("--spy", default="", help="directory: py-spy profiles per step")
    parser.add_argument("--top", type=int, default=12, help="statement shapes to list")
    args = parser.parse_args()

    def configure(stack: Any) -> None:
        # one web process to measure (make up runs more: the configuration line says so)
        set_arg(stack.web.args, "--workers", "1")
        stack.web.env = {**stack.env, "HEDGEROW_DB_POOL": "1", "PGAPPNAME": "web"}
        stack.worker.env = {**stack.env, "PGAPPNAME": "worker"}
        set_arg(stack.worker.args, "-c", str(args.worker_concurrency))
        stack.worker.args += ["-P", args.worker_pool]
        if args.statements:
            import psycopg

            from apps.core.env import db_conninfo

            db = os.environ["HEDGEROW_DB_NAME"]
            with psycopg.connect(db_conninfo(db), autocommit=True) as conn:
                conn.execute(f"ALTER DATABASE \"{db}\" SET log_statement = 'all'")

    env = {"HEDGEROW_MAX_LIVE_SANDBOXES": "0"}
    with private_stack("lcc", env, configure) as (stack, secret):
        assert stack.web.popen is not None and stack.worker.popen is not None
        web, worker = stack.web.popen.pid, stack.worker.popen.pid
        statements = Statements(os.environ["HEDGEROW_DB_NAME"]) if args.statements else None
        if statements is not None:
            time.sleep(0.5)
            statements.take()  # the stack's start-up is not a step
        rows = asyncio.run(run(stack.url, secret, args, web, worker, statements))
        print(
            f"lifecycle_cost: N={args.n} K={args.k} concurrency={args.concurrency} "
            f"worker-concurrency={args.worker_concurrency} pool={args.worker_pool} "
            f"load={Path('/proc/loadavg').read_text().split()[0]}"
        )
        head = ("step", "count", "web ms", "worker ms", "(main)", "+children", "SQL web", "SQL wrk")
        print("{:<10} {:>6} {:>8} {:>10} {:>8} {:>10} {:>8} {:>8}".format(*head))
        for name, count, web_s, worker_s, main_s, children_s, sql in rows:
            print(
                f"{name:<10} {count:>6} {1e3 * web_s / count:8.2f} "
                f"{1e3 * worker_s / count:10.2f} {1e3 * main_s / count:8.2f} "
                f"{1e3 * children_s / count:10.2f} "
                f"{sql.get('web', 0) / count:8.2f} {sql.get('worker', 0) / count:8.2f}"
            )
    return 0


async def run(
    url: str, secret: str, args: Any, web: int, worker: int, statements: Statements | None
) -> list[tuple[str, int, float, float, float, float, Counter[str]]]:
    client = Client(url + "/api/v1", headers={"Authorization": f"Bearer {secret}"})
    ids: list[str] = [""] * args.n
    failed: set[int] = set()
    rows: list[tuple[str, int, float, float, float, float, Counter[str]]] = []
    all_shapes: list[tuple[str, Counter[tuple[str, str]]]] = []

    async def measured(name: str, count: int, body: Callable[[], Awaitable[None]]) -> None:
        spies = _spy_start(name, web, worker, args.spy) if args.spy else []
        w0, k0, m0 = tree_ticks(web), tree_ticks(worker), own_ticks(worker)
        await body()
        await asyncio.sleep(0.3)  # let the step's after-commit work land
        w1, k1, m1 = tree_ticks(web), tree_ticks(worker), own_ticks(worker)
        web_s = (sum(w1) - sum(w0)) / _TICK
        worker_s = (k1[0] - k0[0]) / _TICK
        children_s = (k1[1] - k0[1]) / _TICK
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        sql: Counter[str] = Counter()
        if statements is not None:
            sql, shapes = statements.take()
            all_shapes.append((name, shapes))
        rows.append((name, count, web_s, worker_s, (m1 - m0) / _TICK, children_s, sql))

    async def create(i: int) -> None:
        r = await client.request(
            "POST",
            "/sandboxes",
            json={"image": "host"},
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        assert r.status_code == 201, r.text
        ids[i] = r.json()["id"]

    async def wait(i: int) -> None:
        r = await client.request("GET", f"/sandboxes/{ids[i]}/wait", params={"timeout": 120})
        if r.status_code != 200:
            failed.add(i)
            print(f"sandbox {ids[i]} did not start: {r.text[:160]}")

    root = Client(url)

    async def healthz(i: int) -> None:
        r = await root.request("GET", "/healthz")
        assert r.status_code == 200, r.text

    async def get(i: int) -> None:
        r = await client.request("GET", f"/sandboxes/{ids[i]}")
        assert r.status_code == 200, r.text

    async def execute(i: int) -> None:
        j = i % args.k
        if i // args.k in failed:
            return
        r = await client.request(
            "POST",
            f"/sandboxes/{ids[i // args.k]}/exec",
            json={"command": f"echo {j}", "operation_id": f"op-{j}"},
        )
        assert r.status_code == 200, r.text

    async def delete(i: int) -> None:
        r = await client.request("DELETE", f"/sandboxes/{ids[i]}")
        assert r.status_code == 202, r.text

    async def deleted() -> None:
        for i in range(args.n):
            while True:
                r = await client.request("GET", f"/sandboxes/{ids[i]}")
                if r.json()["state"] in ("deleted", "failed"):
                    break
                await asyncio.sleep(0.2)

    await measured("create", args.n, lambda: _many(args.n, args.concurrency, create))
    await measured("wait", args.n, lambda: _many(args.n, args.concurrency, wait))
    # Baselines: Django's middleware stack alone, and a DRF read of one row.
    await measured("healthz", args.n, lambda: _many(args.n, args.concurrency, healthz))
    await measured("get", args.n, lambda: _many(args.n, args.concurrency, get))
    await measured(
        "exec", args.n * args.k, lambda: _many(args.n * args.k, args.concurrency, execute)
    )
    await measured("delete", args.n, lambda: _many(args.n, args.concurrency, delete))
    # The polls' own web CPU and statements are in this row's web columns; read the
    # worker column (destroy) here.
    await measured("destroyed", args.n, deleted)
    await client.aclose()
    await root.aclose()
    if all_shapes:
        for name, shapes in all_shapes:
            print(f"-- {name}: most frequent statements (count, process, shape)")
            for (role, shape), count in shapes.most_common(args.top):
                print(f"{count:6d} {role:<7} {shape}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
