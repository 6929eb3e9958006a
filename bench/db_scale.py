"""The database over time (issue 20): a private stack configured like `make up`, a
history generated through the services, then the tenant's pages and APIs timed over it.

    .venv/bin/python -m bench.db_scale [--scale 1.0] [--samples 30] [--jobs 3]
        [--budget 60] [--state DIR | --reuse DIR]

``--state DIR`` keeps the generated database (in the running Postgres, the one
``HEDGEROW_STATE_DIR`` names; its name is derived from DIR) and records it in
``DIR/state.json`` once generation has finished; a ``--state DIR`` run that was
interrupted leaves ``DIR/started.json`` and its database, and the same command resumes it
(each batch is one transaction: the batches already written are skipped). ``--reuse
DIR`` measures that database again without generating: migrated first (so another
branch's new index is measured too), a new API key issued, the member and the audit's
period start taken from the kept run.

At ``--scale 1``: 10,000 live (``ready``) sandboxes, ~94,000 ended ones (each created,
provisioned, ready, deleted: five ledger rows and a closed usage record) — together
~500,000 lifecycle-ledger rows — and 500,000 finished operations, so one million ledger
events and operations; plus 2,000 closed episodes. ``--scale 0.05`` is the minute-long
run. Everything is written by the services a real run uses: the lifecycle writer
(``sandbox_insert`` and the compare-and-set ``sandbox_transition``, whose statement also
writes the usage ledger), the exec steps (``operation_start`` then
``operation_record_result``) and the episode services (``episode_open`` /
``episode_close``); never a raw INSERT. The sandboxes use **no backend process**: the
provisioning step's transitions are written without ``backend.provision`` (the live ones
carry an endpoint nobody answers on), so no exec is served and the reconciler is not
run (it would find none of them in the backend and mark them ``lost``). All the history
is written now, so nothing is old enough for retention to thin: its round is the cost
of finding nothing due.

How it is written fast enough (still through the services, the same rows): ``--jobs``
worker **processes** forked from this one (threads share one GIL), each with its own
connection at ``SET synchronous_commit = off`` (a commit does not wait for the WAL
flush: the same rows, not durable against a crash of Postgres in the last moments, which
a benchmark does not need), ``BATCH`` sandboxes with their operations per transaction.
At full size on this 2-core machine, shared with other sessions, that is the difference
between ~115 rows/s (4 threads) and the rate it prints; raise ``--jobs`` on a loaded
machine (each process's share of the CPU is what bounds it).

Then, p50/p95 over ``--samples`` requests each, sequential, through the real HTTP API
(the tenant's key) and the dashboard (a member's session): the sandbox list's first page
and a cursor page deep in the history, a sandbox's detail and operations, the episode
list, the usage API and page, and the team's audit over its whole history (computed as
the worker computes it, ``audit_run``, in this process). A request kind's sampling stops
once it took ``--budget`` seconds (at least 3 samples; ``n`` is printed). Also each table's
``pg_total_relation_size`` before and after (growth per million operations), and one
round of each background job at that size: wall time and rows Postgres read
(``pg_stat_xact_user_tables``; each round's writes are rolled back).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bench._http import Client
from bench._stack import private_stack
from bench.lifecycle import pct

TABLES_SQL = (
    "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables "
    "ORDER BY pg_total_relation_size(relid) DESC"
)


def _sizes() -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(TABLES_SQL)
        return {name: int(size) for name, size in cursor.fetchall()}


def _rows_read() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0) "
            "FROM pg_stat_xact_user_tables"
        )
        return int(cursor.fetchone()[0])


class _Gen:
    """Writes one sandbox's history through the services."""

    def __init__(self, tenant: Any, actor: str) -> None:
        from apps.sandboxes.models import Sandbox

        self.tenant, self.actor = tenant, actor
        self.Sandbox = Sandbox

    def sandbox(self, n: int) -> Any:
        """Created as the API creates it, then provisioned as the provisioning task
        marks it (its claim and its ready transition), without a backend process."""
        from django.utils import timezone

        from apps.sandboxes.backends.base import Endpoint
        from apps.sandboxes.models import State
        from apps.sandboxes.services.lifecycle import sandbox_insert
        from apps.sandboxes.services.provisioning import provision_claim, provision_mark_ready

        sandbox = self.Sandbox(
            tenant=self.tenant,
            external_id=external_id(n),
            image="host",
            cpu_millis=1000,
            memory_mib=512,
            ttl_seconds=30 * 86400,
            expires_at=timezone.now() + timedelta(days=30),
            backend="local",
            admitted_at=timezone.now(),
            created_by=self.actor,
            labels={"run": f"r{n % 50}"},
        )
        sandbox_insert(sandbox=sandbox, state=State.REQUESTED, actor=self.actor)
        provision_claim(sandbox)
        # port 9 is discard: no agent answers (no backend process)
        provision_mark_ready(sandbox, Endpoint("127.0.0.1", 9, isolation="none", node="bench"))
        return sandbox

    def end(self, sandbox: Any) -> None:
        """Deleted as a client deletes it, then destroyed (no backend call)."""
        from django.utils import timezone

        from apps.sandboxes.models import State
        from apps.sandboxes.services.lifecycle import sandbox_transition

        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.READY,),
            to_state=State.TERMINATING,
            reason="deleted",
            actor=self.actor,
        )
        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.TERMINATING,),
            to_state=State.DELETED,
            reason="destroyed",
            terminated_at=timezone.now(),
        )

    def operations(self, sandbox: Any, count: int, principal: Any) -> None:
        from apps.sandboxes.services.operations import (
            ExecRequest,
            operation_record_result,
            operation_start,
        )

        for i in range(count):
            op, _ = operation_start(
                principal=principal,
                sandbox=sandbox,
                request=ExecRequest(command=f"python step.py --n {i}"),
                operation_id=None,
            )
            out = f"step {i}: ok " + "x" * 160
            operation_record_result(
                operation=op,
                result={
                    "termination": {"reason": "exited", "exit_code": 0 if i % 20 else 1},
                    "stdout": {"head": out, "tail": "", "total_bytes": len(out)},
                    "stderr": {"head": "", "tail": "", "total_bytes": 0},
                    "usage": {"wall_s": 0.01 * (i % 7 + 1), "cpu_s": 0.004},
                },
            )


def external_id(n: int) -> str:
    return f"sb-{n:07d}"


BATCH = 100  # sandboxes per transaction


def generate(
    tenant: Any,
    principal: Any,
    *,
    live: int,
    ended: int,
    ops: int,
    episodes: int,
    jobs: int,
    since: datetime | None = None,
) -> str:
    """Writes the history, ``jobs`` worker processes at once (forked from this one,
    each with its own connection at ``synchronous_commit = off``: the same rows,
    committed without waiting for the WAL flush; batches of ``BATCH`` sandboxes per
    transaction); returns the external id of the busy live sandbox (1 % of the
    operations: a sandbox whose operation list pages). ``since``: the history is spread
    from then to now on a simulated clock (``batch_instant``), the oldest first."""
    import multiprocessing

    from django.db import connections

    total = live + ended
    busy_ops = ops // 100
    per_sandbox, extra = divmod(ops - busy_ops, total)
    # history first (oldest), the live ones last: the newest pages are the live ones
    plan = [(i < ended, per_sandbox + (1 if i < extra else 0)) for i in range(total)]
    plan[-1] = (False, plan[-1][1] + busy_ops)
    # a resumed run (an interrupted ``--state`` one) skips the batches already written:
    # each is one transaction, so it is there whole or not at all
    from apps.sandboxes.models import Sandbox

    written = set(Sandbox.objects.filter(tenant=tenant).values_list("external_id", flat=True))
    batches = [
        range(i, min(i + BATCH, total))
        for i in range(0, total, BATCH)
        if external_id(i + 1) not in written
    ]
    if written:
        print(f"  resuming: {len(written)} sandboxes already written, skipped", flush=True)
    total = sum(len(batch) for batch in batches)  # to write in this run
    context = multiprocessing.get_context("fork")
    progress = context.Array("q", 2)  # sandboxes, rows (ledger events + operations)
    connections.close_all()  # each process opens its own
    # in order within a process; processes interleave, so created_at is only roughly ordered
    procs = [
        context.Process(
            target=_lane,
            args=(
                tenant,
                principal,
                plan,
                batches[j::jobs],
                progress,
                total,
                time.perf_counter(),
                since,
            ),
        )
        for j in range(jobs)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [proc.exitcode for proc in procs if proc.exitcode]
    if failed:
        raise SystemExit(f"a generating process failed (exit codes {failed})")
    _episodes(tenant, principal, episodes, jobs)
    return external_id(len(plan))


def _lane(
    tenant: Any,
    principal: Any,
    plan: list[tuple[bool, int]],
    batches: list[range],
    progress: Any,
    total: int,
    t0: float,
    since: datetime | None,
) -> None:
    """One generating process: its batches, each in a transaction (at its instant on
    the simulated clock when ``since`` is given)."""
    import contextlib

    import time_machine
    from django.db import connection, transaction
    from django.utils import timezone

    gen = _Gen(tenant, principal.actor)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit = off")
        for batch in batches:
            rows = 0
            clock: Any = contextlib.nullcontext()
            if since is not None:
                at = batch_instant(since, timezone.now(), batch.start, len(plan))
                clock = time_machine.travel(at, tick=True)
            with clock, transaction.atomic():
                for i in batch:
                    is_ended, n_ops = plan[i]
                    # operations run while it is ready; an ended one is then deleted
                    sandbox = gen.sandbox(i + 1)
                    gen.operations(sandbox, n_ops, principal)
                    if is_ended:
                        gen.end(sandbox)
                    rows += n_ops + (5 if is_ended else 3)
            with progress.get_lock():
                before = progress[0]
                progress[0] += len(batch)
                progress[1] += rows
                done, written = progress[0], progress[1]
            if done // 5000 != before // 5000 or done == total:
                took = time.perf_counter() - t0
                print(
                    f"  {done}/{total} sandboxes written, {written} rows "
                    f"({written / took:.0f} rows/s, load {_load()})",
                    flush=True,
                )
    finally:
        connection.close()


def batch_instant(since: datetime, now: datetime, index: int, total: int) -> datetime:
    """When sandbox ``index`` of ``total`` is written on the simulated clock: evenly from
    ``since`` to a minute before ``now``, in plan order (ended history first, the live
    sandboxes last, so they are the newest)."""
    span = (now - timedelta(minutes=1)) - since
    return since + span * (index / max(total, 1))


def rollup_finished_days(since: datetime) -> tuple[int, float]:
    """The daily usage roll-up of every finished day since ``since``, as the beat's
    ``usage-rollup`` would have written it day after day: (days, seconds)."""
    from django.utils import timezone

    from apps.billing.reports import daily_usage_rebuild

    t0 = time.perf_counter()
    day, today, n = since.date(), timezone.now().date(), 0
    while day < today:
        daily_usage_rebuild(day=day)
        day += timedelta(days=1)
        n += 1
    return n, time.perf_counter() - t0


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def _episodes(tenant: Any, principal: Any, episodes: int, jobs: int) -> None:
    """``episodes`` closed episodes, each on one live sandbox (``episode_open`` with the
    sandbox attached, ``episode_close``: attribution, cost, the difficulty counts)."""
    from django.db import connection

    from apps.sandboxes.models import Sandbox, State
    from apps.trajectories.models import Episode
    from apps.trajectories.services.episodes import EpisodeResult, episode_close, episode_open

    episodes -= Episode.objects.filter(tenant=tenant).count()  # a resumed run's
    live_ids = list(
        Sandbox.objects.filter(tenant=tenant, state=State.READY).values_list(
            "external_id", flat=True
        )[: max(1, episodes)]
    )

    def worker(lane: range) -> None:
        try:
            for i in lane:
                episode, _ = episode_open(
                    tenant=tenant,
                    actor=principal.actor,
                    fields={"task_id": f"task-{i % 500}", "attempt_id": f"a{i}", "harness": "b"},
                    sandbox_ids=[live_ids[i % len(live_ids)]],
                )
                episode_close(
                    episode=episode,
                    result=EpisodeResult(termination_reason="submitted", reward=float(i % 2)),
                )
        finally:
            connection.close()

    threads = [
        threading.Thread(target=worker, args=(range(j, episodes, jobs),)) for j in range(jobs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


async def sample(
    client: Client, path: str, n: int, budget: float = float("inf"), **kw: Any
) -> tuple[list[float], str]:
    """``n`` sequential GETs; stops at the first answer that is not a 200 (returned),
    or once they took ``budget`` seconds and at least 3 were made (a request that takes
    tens of seconds at full size is not sampled 30 times; the count is printed)."""
    times: list[float] = []
    for _ in range(n):
        if len(times) >= 3 and sum(times) >= budget:
            break
        t = time.perf_counter()
        response = await client.request("GET", path, **kw)
        times.append(time.perf_counter() - t)
        if response.status_code != 200:
            return times, f"{response.status_code}: {response.text[:200]}"
    return times, ""


async def deep_cursor(client: Client, depth: int) -> str:
    """The cursor of the page ``depth`` rows down the newest-first list."""
    cursor, seen = "", 0
    while seen < depth:
        params: dict[str, Any] = {"limit": 200}
        if cursor:
            params["cursor"] = cursor
        response = await client.request("GET", "/api/v1/sandboxes", params=params)
        if response.status_code != 200:
            raise SystemExit(f"list page answered {response.status_code}: {response.text[:300]}")
        page = response.json()
        seen += len(page["results"])
        cursor = page.get("next_cursor") or ""
        if not cursor:
            break
    return cursor


def round_cost(fn: Callable[[], Any]) -> tuple[float, int, str]:
    """(seconds, rows read, result) of one background round; its writes rolled back."""
    from django.db import transaction

    with transaction.atomic():
        before = _rows_read()
        t = time.perf_counter()
        result = fn()
        took = time.perf_counter() - t
        rows = _rows_read() - before
        transaction.set_rollback(True)
    return took, rows, str(result)[:80]


STATE_FILE = "state.json"
STARTED_FILE = "started.json"  # the start and sizes before, for a resumed generation


def state_database(directory: Path) -> str:
    """The kept database's name: one per state directory (its resolved path)."""
    digest = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:12]
    return f"hr_dbscale_{digest}"


def read_state(
    parser: argparse.ArgumentParser, state: Path | None, reuse: Path | None
) -> dict[str, Any] | None:
    """Checks ``--state``/``--reuse``; returns the kept run's record for ``--reuse``
    (None otherwise). Errors through ``parser.error`` (exit 2, a message)."""
    if state is not None and reuse is not None:
        parser.error("--state and --reuse exclude each other (--reuse measures a kept state)")
    if state is not None and (state / STATE_FILE).exists():
        parser.error(
            f"{state} already holds a kept database ({state / STATE_FILE}): "
            f"measure it with --reuse {state}, or remove the directory to generate anew"
        )
    if reuse is None:
        return None
    try:
        record: dict[str, Any] = json.loads((reuse / STATE_FILE).read_text())
    except FileNotFoundError:
        parser.error(
            f"{reuse} holds no kept database (no {STATE_FILE}: made with --state {reuse}, "
            "and did its generation finish?)"
        )
    except ValueError as exc:
        parser.error(f"{reuse / STATE_FILE} is not valid JSON: {exc}")
    missing = {"database", "live", "ended", "ops", "episodes", "start", "busy"} - set(record)
    if missing:
        parser.error(f"{reuse / STATE_FILE} lacks {', '.join(sorted(missing))}")
    return record


def _database_exists(name: str) -> bool:
    """Whether an interrupted ``--state`` run left its database (generation unfinished:
    the run resumes it)."""
    import psycopg

    from apps.core.env import db_conninfo

    with psycopg.connect(db_conninfo("postgres"), autocommit=True) as admin:
        found = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
        return found.fetchone() is not None


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "?"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds per request kind: its sampling stops there (at least 3 samples)",
    )
    parser.add_argument("--jobs", type=int, default=3, help="processes writing the history")
    parser.add_argument(
        "--days",
        type=float,
        default=0.0,
        help="spread the history over the last DAYS days on a simulated clock "
        "(time-machine), then roll up each finished day as the beat would have; "
        "0: all of it written now (every record falls on today: the roll-up holds none)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        metavar="DIR",
        help="keep the generated database (in the running Postgres) and record it in DIR",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        metavar="DIR",
        help="measure the database a --state DIR run kept (migrated first), no generation",
    )
    args = parser.parse_args()
    kept = read_state(parser, args.state, args.reuse)
    if kept is not None:
        live, ended, ops, episodes = kept["live"], kept["ended"], kept["ops"], kept["episodes"]
        args.scale = kept.get("scale", args.scale)
        args.days = kept.get("days", 0.0)
    else:
        live = max(1, round(10_000 * args.scale))
        ops = round(500_000 * args.scale)
        ended = max(0, round(500_000 * args.scale) - 3 * live) // 5
        episodes = max(1, round(2_000 * args.scale))
    database = None
    if args.reuse is not None:
        database = str(kept["database"]) if kept is not None else None
    elif args.state is not None:
        database = state_database(args.state)
        args.state.mkdir(parents=True, exist_ok=True)

    spread = (
        f"spread over the last {args.days:g} days on a simulated clock"
        if args.days
        else "all written now (every usage record falls on today)"
    )
    print(
        f"{'reusing ' + str(args.reuse) + ' (' + str(database) + '), ' if args.reuse else ''}"
        f"no beat (its jobs are run once below); scale {args.scale}: {live} live + {ended} "
        f"ended sandboxes, {ops} operations, {episodes} episodes; sandboxes use no backend "
        f"process (provisioning's transitions written without backend.provision; no agent "
        f"answers); history: {spread}; load average {_load()}",
        flush=True,
    )
    resume = False
    if args.state is not None and database is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        resume = _database_exists(database)
    with private_stack(
        "dbs",
        {"HEDGEROW_MAX_LIVE_SANDBOXES": "0"},
        database=database,
        reuse=args.reuse is not None or resume,
        keep=database is not None,
    ) as (stack, secret):
        from django.contrib.auth.models import User
        from django.db import connection
        from django.test import Client as DjangoClient
        from django.utils import timezone

        from apps.sandboxes.models import Operation, Sandbox, SandboxEvent
        from apps.tenancy.models import ApiKey, Tenant
        from apps.tenancy.principal import Principal
        from apps.tenancy.services import membership_set_role

        tenant = Tenant.objects.get(slug="bench")
        key = ApiKey.objects.get(tenant=tenant, name=f"bench {os.getpid()}")
        principal = Principal(tenant=tenant, scopes=frozenset({"read", "write"}), api_key=key)
        user, made = User.objects.get_or_create(username="bench")
        if made:
            user.set_unusable_password()
            user.save()
            membership_set_role(tenant=tenant, user=user, role="owner")
        if kept is not None:
            start = datetime.fromisoformat(kept["start"])
            before = {k: int(v) for k, v in kept.get("sizes_before", {}).items()}
            busy = str(kept["busy"])
            generated = kept.get("generated", {})
            print(
                f"kept state: generated {generated.get('date', '?')} at commit "
                f"{generated.get('commit', '?')} in {generated.get('seconds', 0):.0f} s; "
                f"measured at commit {_commit()} (migrated)",
                flush=True,
            )
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE")
        else:
            start = timezone.now() - timedelta(days=args.days, seconds=1)
            before = _sizes()
            started = args.state / STARTED_FILE if args.state is not None else None
            if started is not None and resume and started.exists():
                first = json.loads(started.read_text())  # the interrupted run's
                start, before = datetime.fromisoformat(first["start"]), first["sizes_before"]
            elif started is not None:
                first = {"start": start.isoformat(), "sizes_before": before}
                started.write_text(json.dumps(first, indent=1) + "\n")
            there = SandboxEvent.objects.count() + Operation.objects.count()  # resumed: > 0
            t0 = time.perf_counter()
            busy = generate(
                tenant,
                principal,
                live=live,
                ended=ended,
                ops=ops,
                episodes=episodes,
                jobs=args.jobs,
                since=start if args.days else None,
            )
            gen_s = time.perf_counter() - t0
            if args.days:
                n_days, took = rollup_finished_days(start)
                print(f"rolled up {n_days} finished days in {took:.1f} s", flush=True)
            with connection.cursor() as cursor:
                cursor.execute("VACUUM ANALYZE")
        after = _sizes()
        n_events = SandboxEvent.objects.count()
        n_ops = Operation.objects.count()
        n_sandboxes = Sandbox.objects.count()
        if kept is None:
            rate = (n_events + n_ops - there) / gen_s
            print(
                f"generated in {gen_s:.0f} s{f' (resumed: {there} rows there)' if there else ''}"
                f" ({rate:.0f} ledger events + operations per s, "
                f"{args.jobs} processes, synchronous_commit off, load {_load()}): "
                f"{n_sandboxes} sandboxes ({live} live), {n_events} ledger events, {n_ops} "
                f"operations, {episodes} episodes",
                flush=True,
            )
            if args.state is not None:
                record = {
                    "database": database,
                    "scale": args.scale,
                    "live": live,
                    "ended": ended,
                    "ops": ops,
                    "episodes": episodes,
                    "start": start.isoformat(),
                    "days": args.days,
                    "busy": busy,
                    "sizes_before": before,
                    "generated": {
                        "seconds": gen_s,
                        "rate": rate,
                        "resumed_rows": there,
                        "jobs": args.jobs,
                        "date": timezone.now().isoformat(timespec="seconds"),
                        "commit": _commit(),
                        "load": _load(),
                    },
                }
                (args.state / STATE_FILE).write_text(json.dumps(record, indent=1) + "\n")
                print(f"kept: database {database}, recorded in {args.state / STATE_FILE}")
        print("\ntable sizes (pg_total_relation_size: heap + indexes + TOAST), growth:")
        grown = sorted(after, key=lambda t: after[t] - before.get(t, 0), reverse=True)
        total = 0
        for table in grown[:10]:
            delta = after[table] - before.get(table, 0)
            total += delta
            print(f"  {table:<36} {delta / 2**20:9.1f} MiB")
        all_delta = sum(after.values()) - sum(before.values())
        per_m = all_delta / max(n_ops, 1) * 1_000_000
        op_table = after["sandboxes_operation"] - before.get("sandboxes_operation", 0)
        print(
            f"  all tables: {all_delta / 2**20:.1f} MiB; per million operations (with their "
            f"share of the ledger and usage): {per_m / 2**30:.2f} GiB; the operation table "
            f"alone {op_table / max(n_ops, 1):.0f} B per operation"
        )

        django_client = DjangoClient()
        django_client.force_login(user)
        cookie = f"sessionid={django_client.cookies['sessionid'].value}"
        api = Client(stack.url, headers={"Authorization": f"Bearer {secret}"})
        web = Client(stack.url, headers={"Cookie": cookie})
        metrics = Client(stack.url, headers={"Authorization": f"Bearer {stack.metrics_token}"})
        detail = busy
        results: list[tuple[str, list[float], float]] = []

        async def measure() -> None:
            n = args.samples
            cursor = await deep_cursor(api, n_sandboxes * 9 // 10)
            checks: list[tuple[str, Client, str, dict[str, Any], float]] = [
                ("API sandbox list, first page", api, "/api/v1/sandboxes", {}, 0.2),
                (
                    "API sandbox list, cursor page at 90 %",
                    api,
                    "/api/v1/sandboxes",
                    {"params": {"cursor": cursor}},
                    0.2,
                ),
                ("API sandbox detail", api, f"/api/v1/sandboxes/{detail}", {}, 0.2),
                (
                    "API sandbox operations",
                    api,
                    f"/api/v1/sandboxes/{detail}/operations",
                    {},
                    0.2,
                ),
                ("API sandbox events", api, f"/api/v1/sandboxes/{detail}/events", {}, 0.2),
                ("API episode list", api, "/api/v1/episodes", {}, 0.2),
                ("API usage", api, "/api/v1/usage", {}, 0.2),
                ("page sandbox list", web, "/sandboxes/", {}, 0.2),
                ("page sandbox table", web, "/sandboxes/table", {}, 0.2),
                ("page sandbox detail", web, f"/sandboxes/{detail}/", {}, 0.2),
                ("page sandbox operations", web, f"/sandboxes/{detail}/operations", {}, 0.2),
                ("page episode list", web, "/trajectories/", {}, 0.2),
                ("page usage", web, "/billing/usage/", {}, 0.2),
                ("page team leaks", web, "/reports/leaks/mine", {}, 0.2),
                ("/metrics scrape", metrics, "/metrics", {}, 2.0),
            ]
            for name, client, path, kw, goal in checks:
                times, failure = await sample(client, path, n, args.budget, **kw)
                if failure:
                    print(f"  {name}: {path} answered {failure}", flush=True)
                results.append((name, times, goal))
            for c in (api, web, metrics):
                await c.aclose()

        asyncio.run(measure())
        from apps.sandboxes.services.audit import AuditSlice, audit_run

        audits: list[float] = []
        report = None
        for _ in range(args.samples):
            if len(audits) >= 3 and sum(audits) >= args.budget:
                break
            t = time.perf_counter()
            report = audit_run(
                period_start=start,
                period_end=timezone.now(),
                audit_slice=AuditSlice(tenant=tenant),
                trigger="manual",
            )
            audits.append(time.perf_counter() - t)
        results.append(("team audit, whole history (in process)", audits, 2.0))
        print(
            f"\nrequests, sequential, {args.samples} each or as many as {args.budget:.0f} s "
            f"allow (at least 3; n below) (goal: p95; load {_load()}):"
        )
        for name, times, goal in results:
            p95 = pct(times, 0.95)
            verdict = "met" if p95 <= goal else "MISSED"
            print(
                f"  {name:<42} n {len(times):2d} p50 {pct(times, 0.5) * 1e3:8.1f} ms  "
                f"p95 {p95 * 1e3:8.1f} ms  "
                f"(goal ≤ {goal * 1e3:.0f} ms: {verdict})"
            )
        if report is not None:
            terms = re.sub(r"\s+", " ", str(getattr(report, "summary", "")))[:200]
            print(f"  last audit: status {report.status}, {terms}")

        from apps.billing.reports import daily_usage_rebuild
        from apps.sandboxes.admission import queue as admission_queue
        from apps.sandboxes.metering import storage as storage_metering
        from apps.sandboxes.metering import usage as usage_metering
        from apps.sandboxes.services.provisioning import sandbox_reap
        from apps.sandboxes.services.recovery import operation_recover_stale
        from apps.sandboxes.services.retention import retention_apply

        jobs: list[tuple[str, Callable[[], Any]]] = [
            ("reapers (10 s)", sandbox_reap),
            ("usage sweep (60 s)", usage_metering.usage_sweep),
            ("usage sweep, daily full", lambda: usage_metering.usage_sweep(full=True)),
            ("storage sweep (60 s)", storage_metering.storage_sweep),
            ("retention (1 h), nothing due", lambda: retention_apply().as_dict()),
            ("usage roll-up (600 s)", lambda: daily_usage_rebuild(day=timezone.now().date())),
            ("admission sweep (5 s)", admission_queue.admission_queue_expire),
            ("operation recovery (30 s)", operation_recover_stale),
        ]
        print(
            f"\nbackground rounds at this size (one each, writes rolled back; load "
            f"{Path('/proc/loadavg').read_text().split()[0]}):"
        )
        for name, fn in jobs:
            took, rows, result = round_cost(fn)
            print(f"  {name:<32} {took * 1e3:9.1f} ms  {rows:9d} rows read  -> {result}")
        print("  reconciler: not run (no backend holds these sandboxes; see the docstring)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
