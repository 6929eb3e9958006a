"""An exec's two writes to the operation table, with and without a HOT result UPDATE
(issue 17 goal 3, migration 0016), measured in Postgres itself.

    .venv/bin/python -m bench.operation_writes DBNAME [--rows 500000] [--execs 2000]
        [--clients 16] [--rounds 3]

DBNAME: a scratch database holding the operation table (e.g. a copy of the db_scale
database: ``createdb -T hr_dbscale_… hr_dbscale_mine``); the connection settings
are the stack's (HEDGEROW_STATE_DIR). The script builds two copies of the table in
schema ``bench_opw`` with the first ``--rows`` operations: ``before`` with the indexes
of migration 0015 (six, one of them on ``(status, created_at)``) and ``after`` with
those of 0016 (four, none on a column the result writes, fillfactor 85), each with the
metrics trigger the real table has (``hedgerow_operation_tally``, so the delta row
each finished exec writes is counted as well). Then, interleaved per round, ``--clients``
connections each run ``--execs / --clients`` exec-shaped pairs on each copy: the
INSERT of a ``running`` row, then the result's compare-and-set UPDATE (autocommit,
as the fast path sends them). Prints per copy: updates and HOT updates (Postgres's
``pg_stat_user_tables``), the backends' CPU per exec (``/proc/<pid>/stat``: Postgres
runs on this machine) and pairs per second; then, on one connection, the WAL each
statement writes (``EXPLAIN (ANALYZE, WAL)``: bytes and records, this backend's own).
No foreign keys on the copies (same for both), so the figures are the indexes' and
the heap's share.
Drops the schema at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

LAYOUTS = {
    "before": [
        "CREATE INDEX ON {t} (status, created_at)",
        "CREATE UNIQUE INDEX ON {t} (sandbox_id, operation_id)",
        "CREATE INDEX ON {t} (created_at)",
        "CREATE INDEX ON {t} (tenant_id)",
        "CREATE INDEX ON {t} (sandbox_id)",
    ],
    "after": [
        "CREATE UNIQUE INDEX ON {t} (sandbox_id, operation_id)",
        "CREATE INDEX ON {t} (created_at)",
        "CREATE INDEX ON {t} (tenant_id)",
        "ALTER TABLE {t} SET (fillfactor = 85)",
    ],
}

TRIGGER = """
CREATE TRIGGER tally_update AFTER UPDATE ON {t}
  FOR EACH ROW WHEN (
    (OLD.finished_at IS NOT NULL OR OLD.status = 'failed'
     OR NEW.finished_at IS NOT NULL OR NEW.status = 'failed')
    AND (OLD.status IS DISTINCT FROM NEW.status OR OLD.error IS DISTINCT FROM NEW.error
         OR OLD.created_at IS DISTINCT FROM NEW.created_at
         OR OLD.finished_at IS DISTINCT FROM NEW.finished_at)
  ) EXECUTE FUNCTION hedgerow_operation_tally()
"""

INSERT = """
INSERT INTO {t} (id, tenant_id, sandbox_id, operation_id, kind, generation, request,
  request_hash, status, termination, exit_code, signal, stdout, stderr, usage,
  children_remained, error, actor, created_at, finished_at)
VALUES (%s, %s, %s, %s, 'exec', 1, %s::jsonb, %s, 'running', '', NULL, NULL, '{{}}',
  '{{}}', '{{}}', false, NULL, %s, now(), NULL)
"""

UPDATE = """
UPDATE {t} SET status = 'completed', termination = 'exited', exit_code = 0, signal = NULL,
  stdout = %s::jsonb, stderr = %s::jsonb, usage = %s::jsonb, children_remained = false,
  error = NULL, finished_at = now()
WHERE id = %s AND status = 'running'
"""

REQUEST = json.dumps({"command": "echo hi", "timeout": 30, "env": {}, "cwd": None})
STDOUT = json.dumps({"data": "hi\n", "truncated": False, "bytes": 3})
EMPTY = json.dumps({"data": "", "truncated": False, "bytes": 0})
USAGE = json.dumps({"cpu_user_ms": 1.1, "cpu_system_ms": 0.6, "wall_ms": 1.4, "max_rss_kib": 3400})


def conninfo(dbname: str) -> str:
    root = Path(os.environ.get("HEDGEROW_STATE_DIR", ".state"))
    password = (root / "db_password").read_text().strip()
    port = os.environ.get("HEDGEROW_DB_PORT", "55432")
    return psycopg.conninfo.make_conninfo(
        dbname=dbname, user="hedgerow", password=password, host="127.0.0.1", port=port
    )


def cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return int(fields[11]) + int(fields[12])  # utime + stime


def build(info: str, rows: int) -> None:
    with psycopg.connect(info, autocommit=True) as db:
        db.execute("DROP SCHEMA IF EXISTS bench_opw CASCADE")
        db.execute("CREATE SCHEMA bench_opw")
        for layout, statements in LAYOUTS.items():
            table = f"bench_opw.{layout}"
            db.execute(f"CREATE TABLE {table} (LIKE public.sandboxes_operation INCLUDING DEFAULTS)")
            db.execute(f"ALTER TABLE {table} ADD PRIMARY KEY (id)")
            for statement in statements:
                if not statement.startswith("ALTER"):
                    db.execute(statement.format(t=table))
            db.execute(
                f"INSERT INTO {table} SELECT * FROM public.sandboxes_operation "
                f"ORDER BY created_at LIMIT %s",
                [rows],
            )
            # As the migration: the history's pages stay packed, the fillfactor holds
            # for the pages written from now on.
            for statement in statements:
                if statement.startswith("ALTER"):
                    db.execute(statement.format(t=table))
            db.execute(TRIGGER.format(t=table))
            db.execute(f"VACUUM ANALYZE {table}")


def sandboxes(info: str, n: int) -> list[tuple[Any, Any]]:
    with psycopg.connect(info) as db:
        return list(
            db.execute(
                "SELECT tenant_id, id FROM sandboxes_sandbox ORDER BY created_at DESC LIMIT %s",
                [n],
            )
        )


def run_round(
    info: str, layout: str, clients: int, per_client: int, pairs: list[Any]
) -> dict[str, float]:
    table = f"bench_opw.{layout}"
    conns = [psycopg.connect(info, autocommit=True) for _ in range(clients)]
    pids = [c.info.backend_pid for c in conns]
    for c in conns:
        c.execute("SELECT 1")
    with psycopg.connect(info, autocommit=True) as watch:

        def stats() -> tuple[int, int]:
            watch.execute("SELECT pg_stat_clear_snapshot()")
            row = watch.execute(
                "SELECT n_tup_upd, n_tup_hot_upd "
                "FROM pg_stat_user_tables WHERE schemaname = 'bench_opw' AND relname = %s",
                [layout],
            ).fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

        upd0, hot0 = stats()
        ticks0 = sum(cpu_ticks(p) for p in pids)
        insert, update = INSERT.format(t=table), UPDATE.format(t=table)

        def work(n: int, conn: psycopg.Connection[Any]) -> None:
            tenant, sandbox = pairs[n % len(pairs)]
            for _ in range(per_client):
                pk = uuid.uuid4()
                conn.execute(
                    insert,
                    [pk, tenant, sandbox, f"op-{uuid.uuid4().hex}", REQUEST, "x" * 64, "bench"],
                    prepare=True,
                )
                conn.execute(update, [STDOUT, EMPTY, USAGE, pk], prepare=True)
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.execute("SELECT 1")  # its end flushes this backend's table counts

        started = time.monotonic()
        threads = [threading.Thread(target=work, args=(n, c)) for n, c in enumerate(conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        ticks = sum(cpu_ticks(p) for p in pids) - ticks0
        for c in conns:
            c.close()
        deadline = time.monotonic() + 15
        execs = clients * per_client
        upd1, hot1 = stats()
        while upd1 - upd0 < execs and time.monotonic() < deadline:
            time.sleep(0.2)  # the closed backends' last counts land
            upd1, hot1 = stats()
    hz = os.sysconf("SC_CLK_TCK")
    return {
        "execs": execs,
        "updates": upd1 - upd0,
        "hot": hot1 - hot0,
        "cpu_ms": ticks / hz * 1000 / execs,
        "per_s": execs / wall,
    }


def wal_per_exec(info: str, layout: str, pairs: list[Any], n: int) -> tuple[float, ...]:
    """(INSERT, UPDATE) bytes, records and full-page images of WAL per exec. A page's
    first change after a checkpoint writes its whole image (8 kB), so the bytes jump
    with the checkpoints other databases' writes bring; the records do not."""
    table = f"bench_opw.{layout}"
    totals = [0.0] * 6
    with psycopg.connect(info, autocommit=True) as db:
        for i in range(n):
            pk = uuid.uuid4()
            tenant, sandbox = pairs[i % len(pairs)]
            statements = (
                (INSERT, [pk, tenant, sandbox, f"op-{uuid.uuid4().hex}", REQUEST, "x" * 64, "b"]),
                (UPDATE, [STDOUT, EMPTY, USAGE, pk]),
            )
            for k, (sql, params) in enumerate(statements):
                explained = db.execute(
                    "EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + sql.format(t=table), params
                ).fetchone()
                assert explained is not None
                plan = explained[0][0]["Plan"]
                totals[k] += plan.get("WAL Bytes", 0)
                totals[k + 2] += plan.get("WAL Records", 0)
                totals[k + 4] += plan.get("WAL FPI", 0)
    return tuple(t / n for t in totals)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dbname")
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--execs", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep schema bench_opw")
    args = parser.parse_args()
    info = conninfo(args.dbname)
    started = datetime.now(UTC)
    build(info, args.rows)
    pairs = sandboxes(info, 64)
    print(
        f"{args.dbname}: {args.rows} rows copied, {started:%Y-%m-%d %H:%M} UTC, "
        f"{args.clients} clients, {args.execs} execs per copy and round"
    )
    print("| round | table | load | execs | updates | HOT | Postgres CPU ms/exec | execs/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    per_client = max(1, args.execs // args.clients)
    try:
        for n in range(args.rounds):
            order = ("before", "after") if n % 2 == 0 else ("after", "before")
            for layout in order:
                load = os.getloadavg()[0]
                r = run_round(info, layout, args.clients, per_client, pairs)
                print(
                    f"| {n + 1} | {layout} | {load:.1f} | {r['execs']:.0f} | {r['updates']:.0f} "
                    f"| {r['hot']:.0f} | {r['cpu_ms']:.3f} | {r['per_s']:.0f} |"
                )
        print(
            "\n| table | WAL B/exec: INSERT | UPDATE | records: INSERT | UPDATE "
            "| full pages: INSERT | UPDATE |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for layout in LAYOUTS:
            w = wal_per_exec(info, layout, pairs, 300)
            print(
                f"| {layout} | {w[0]:.0f} | {w[1]:.0f} | {w[2]:.1f} | {w[3]:.1f} "
                f"| {w[4]:.2f} | {w[5]:.2f} |"
            )
    finally:
        if not args.keep:
            with psycopg.connect(info, autocommit=True) as db:
                db.execute("DROP SCHEMA bench_opw CASCADE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
