"""What the metric tallies cost the writers (issue 20; services/metrics_tally.py): an
operation's finishing UPDATE with the tally trigger on and off, and a fold.

    .venv/bin/python -m bench.metrics_tally [--ops 4000] [--block 250]

Builds its own database with the migrations (like the tests: ``HEDGEROW_TEST_DB_NAME``,
dropped at the end), one sandbox and ``--ops`` running operations, then finishes them
one autocommitted UPDATE each (the statement ``operation_record_result`` ends an exec
with), alternating blocks of ``--block`` with the operation's update trigger enabled and
disabled, so both halves see the same load. Reports the median per-UPDATE wall time of
each half and the time of one fold of the deltas the enabled half wrote.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from datetime import timedelta


def _in_server(*, table: str, trigger: str, reset: str, change: str) -> dict[bool, float]:
    """Microseconds per row of ``UPDATE table SET change`` one row at a time in a plpgsql
    loop, with ``trigger`` enabled and disabled, best of four each (``reset`` between)."""
    from django.db import connection

    best: dict[bool, float] = {}
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table}")
        rows = int(cursor.fetchone()[0])
        cursor.execute(
            "CREATE OR REPLACE FUNCTION pg_temp.change_all() RETURNS float8 "
            "LANGUAGE plpgsql AS $$ DECLARE r record; "
            "t0 timestamptz := clock_timestamp(); BEGIN "
            f"FOR r IN SELECT id FROM {table} LOOP "
            f"UPDATE {table} SET {change} WHERE id = r.id; END LOOP; "
            "RETURN EXTRACT(EPOCH FROM clock_timestamp() - t0) * 1e6; END $$"
        )
        for enabled in (True, False) * 4:
            verb = "ENABLE" if enabled else "DISABLE"
            cursor.execute(f"ALTER TABLE {table} {verb} TRIGGER {trigger}")
            cursor.execute(f"UPDATE {table} SET {reset}")
            cursor.execute("SELECT pg_temp.change_all()")
            micros = float(cursor.fetchone()[0]) / rows
            best[enabled] = min(best.get(enabled, micros), micros)
        cursor.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=4000)
    parser.add_argument("--block", type=int, default=250)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("HEDGEROW_TEST_DB_NAME", f"bench_tally_{os.getpid()}")
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases
    from django.utils import timezone

    old = setup_databases(verbosity=0, interactive=False)
    try:
        from apps.sandboxes.models import MetricsDelta, Operation, Sandbox
        from apps.sandboxes.services.metrics_tally import tallies
        from apps.tenancy.models import Tenant

        tenant = Tenant.objects.create(slug=f"bench-{uuid.uuid4().hex[:8]}", name="bench")
        now = timezone.now()
        sandbox = Sandbox.objects.create(
            tenant=tenant,
            external_id="bench",
            state="ready",
            image="host",
            cpu_millis=1000,
            memory_mib=512,
            ttl_seconds=3600,
            expires_at=now + timedelta(hours=1),
            backend="local",
            ready_at=now,
        )
        ops = Operation.objects.bulk_create(
            Operation(
                tenant=tenant,
                sandbox=sandbox,
                operation_id=f"op-{i}",
                generation=1,
                request={"command": ["true"]},
                request_hash="h",
                status="running",
                created_at=now,
            )
            for i in range(args.ops)
        )
        timed: dict[bool, list[float]] = {True: [], False: []}
        for start in range(0, len(ops), args.block):
            enabled = (start // args.block) % 2 == 0
            with connection.cursor() as cursor:
                verb = "ENABLE" if enabled else "DISABLE"
                cursor.execute(
                    f"ALTER TABLE sandboxes_operation {verb} TRIGGER operation_tally_update"
                )
            for i, op in enumerate(ops[start : start + args.block]):
                t0 = time.perf_counter()
                Operation.objects.filter(pk=op.pk).update(
                    status="completed",
                    exit_code=0,
                    finished_at=now + timedelta(milliseconds=3 + i % 50),
                )
                timed[enabled].append(time.perf_counter() - t0)
        # the same inside the server (no client round trip, one backend's own clock):
        # rows finished one UPDATE each by a loop, trigger on then off, four times
        per_row = _in_server(
            table="sandboxes_operation",
            trigger="operation_tally_update",
            reset="status = 'running', finished_at = NULL",
            change="status = 'completed', finished_at = created_at + interval '7 ms'",
        )
        print(
            f"in the server, per finishing UPDATE: trigger on {per_row[True]:.1f} us, "
            f"off {per_row[False]:.1f} us (best of 4 each)"
        )
        # a sandbox transition (ready -> terminating): two delta rows (-1 old, +1 new)
        Sandbox.objects.bulk_create(
            Sandbox(
                tenant=tenant,
                external_id=f"bench-{i}",
                state="ready",
                image="host",
                cpu_millis=1000,
                memory_mib=512,
                ttl_seconds=3600,
                expires_at=now + timedelta(hours=1),
                backend="local",
                ready_at=now,
            )
            for i in range(args.ops)
        )
        per_row = _in_server(
            table="sandboxes_sandbox",
            trigger="sandbox_tally_update",
            reset="state = 'ready'",
            change="state = 'terminating'",
        )
        print(
            f"in the server, per sandbox transition: trigger on {per_row[True]:.1f} us, "
            f"off {per_row[False]:.1f} us (best of 4 each)"
        )
        deltas = MetricsDelta.objects.count()
        t0 = time.perf_counter()
        tallies()
        fold_s = time.perf_counter() - t0
        on, off = statistics.median(timed[True]), statistics.median(timed[False])
        print(
            f"finishing UPDATE, median of {len(timed[True])}: trigger on {on * 1e3:.3f} ms, "
            f"off {off * 1e3:.3f} ms, difference {(on - off) * 1e6:+.0f} us"
        )
        print(f"fold of {deltas} deltas: {fold_s * 1e3:.1f} ms")
        print(f"load average: {os.getloadavg()}")
    finally:
        teardown_databases(old, verbosity=0)


if __name__ == "__main__":
    main()
