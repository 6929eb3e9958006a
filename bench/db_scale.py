"""The database over time (issue 20): a private stack configured like `make up`, a
history generated through the services, then the tenant's pages and APIs timed over it.

    .venv/bin/python -m bench.db_scale [--scale 1.0] [--samples 30]

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

Then, p50/p95 over ``--samples`` requests each, sequential, through the real HTTP API
(the tenant's key) and the dashboard (a member's session): the sandbox list's first page
and a cursor page deep in the history, a sandbox's detail and operations, the episode
list, the usage API and page, and the team's audit over its whole history (computed as
the worker computes it, ``audit_run``, in this process). Also each table's
``pg_total_relation_size`` before and after (growth per million operations), and one
round of each background job at that size: wall time and rows Postgres read
(``pg_stat_xact_user_tables``; each round's writes are rolled back).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench._http import Client
from bench._stack import private_stack
from bench.lifecycle import pct

MAKE_UP = {"web_workers": 2, "worker_concurrency": 4}
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
    """Writes the history through the services, in transactions of ``batch`` rows."""

    def __init__(self, tenant: Any, actor: str) -> None:
        from apps.sandboxes.models import Sandbox

        self.tenant, self.actor = tenant, actor
        self.Sandbox = Sandbox
        self.counter = itertools.count(1)

    def sandbox(self) -> Any:
        from django.utils import timezone

        from apps.sandboxes.models import State
        from apps.sandboxes.services.lifecycle import sandbox_insert, sandbox_transition

        n = next(self.counter)
        sandbox = self.Sandbox(
            tenant=self.tenant,
            external_id=f"sb-{n:07d}",
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
        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.REQUESTED,),
            to_state=State.PROVISIONING,
            reason="scheduled",
            bump_generation=True,
            provisioning_started_at=timezone.now(),
        )
        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.PROVISIONING,),
            to_state=State.READY,
            reason="agent_healthy",
            endpoint_host="127.0.0.1",
            endpoint_port=9,  # discard: no agent answers (no backend process)
            isolation="none",
            node="bench",
            ready_at=timezone.now(),
        )
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


def generate(
    tenant: Any, principal: Any, *, live: int, ended: int, ops: int, episodes: int, jobs: int
) -> Any:
    """Writes the history, ``jobs`` threads at once (each its own connection, batches of
    100 sandboxes per transaction); returns the busy live sandbox (1 % of the
    operations: a sandbox whose operation list pages)."""
    from django.db import connection, transaction

    gen = _Gen(tenant, principal.actor)
    total = live + ended
    busy_ops = ops // 100
    per_sandbox, extra = divmod(ops - busy_ops, total)
    # history first (oldest), the live ones last: the newest pages are the live ones
    plan = [(i < ended, per_sandbox + (1 if i < extra else 0)) for i in range(total)]
    plan[-1] = (False, plan[-1][1] + busy_ops)
    batches = [plan[i : i + 100] for i in range(0, total, 100)]
    done = [0]
    lock = threading.Lock()
    busy: list[Any] = []
    t0 = time.perf_counter()

    def worker(mine: list[list[tuple[bool, int]]]) -> None:
        try:
            for batch in mine:
                with transaction.atomic():
                    for is_ended, n_ops in batch:
                        # operations run while it is ready; an ended one is then deleted
                        sandbox = gen.sandbox()
                        gen.operations(sandbox, n_ops, principal)
                        if is_ended:
                            gen.end(sandbox)
                        elif n_ops > busy_ops:
                            busy.append(sandbox)
                with lock:
                    before, done[0] = done[0], done[0] + len(batch)
                    if done[0] // 5000 != before // 5000 or done[0] == total:
                        rate = done[0] / (time.perf_counter() - t0)
                        print(f"  {done[0]}/{total} sandboxes written ({rate:.0f}/s)", flush=True)
        finally:
            connection.close()

    # in order within a thread; threads interleave, so created_at is only roughly ordered
    lanes = [batches[i::jobs] for i in range(jobs)]
    threads = [threading.Thread(target=worker, args=(lane,)) for lane in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _episodes(tenant, principal, episodes, jobs)
    return busy[0] if busy else None


def _episodes(tenant: Any, principal: Any, episodes: int, jobs: int) -> None:
    """``episodes`` closed episodes, each on one live sandbox (``episode_open`` with the
    sandbox attached, ``episode_close``: attribution, cost, the difficulty counts)."""
    from django.db import connection

    from apps.sandboxes.models import Sandbox, State
    from apps.trajectories.services.episodes import EpisodeResult, episode_close, episode_open

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


async def sample(client: Client, path: str, n: int, **kw: Any) -> tuple[list[float], str]:
    """``n`` sequential GETs; stops at the first answer that is not a 200 (returned)."""
    times: list[float] = []
    for _ in range(n):
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=4, help="threads writing the history")
    args = parser.parse_args()
    live = max(1, round(10_000 * args.scale))
    ops = round(500_000 * args.scale)
    ended = max(0, round(500_000 * args.scale) - 3 * live) // 5
    episodes = max(1, round(2_000 * args.scale))

    def configure(stack: Any) -> None:
        stack.web.args += ["--workers", str(MAKE_UP["web_workers"])]
        stack.web.env = {**stack.env, "HEDGEROW_DB_POOL": "1"}
        stack.worker.args[stack.worker.args.index("-c") + 1] = str(MAKE_UP["worker_concurrency"])

    print(
        f"configuration (as make up): {MAKE_UP['web_workers']} web workers with the DB pool, "
        f"Celery worker -c {MAKE_UP['worker_concurrency']}, no beat (its jobs are run once "
        f"below); scale {args.scale}: {live} live + {ended} ended sandboxes, {ops} operations, "
        f"{episodes} episodes; sandboxes use no backend process (provisioning's transitions "
        f"written without backend.provision; no agent answers); load average "
        f"{Path('/proc/loadavg').read_text().split()[0]}",
        flush=True,
    )
    with private_stack("dbs", {"HEDGEROW_MAX_LIVE_SANDBOXES": "0"}, configure) as (stack, secret):
        from django.contrib.auth.models import User
        from django.db import connection
        from django.test import Client as DjangoClient
        from django.utils import timezone

        from apps.sandboxes.models import Operation, Sandbox, SandboxEvent
        from apps.tenancy.models import ApiKey, Tenant
        from apps.tenancy.principal import Principal
        from apps.tenancy.services import membership_set_role

        tenant = Tenant.objects.get(slug="bench")
        key = ApiKey.objects.get(tenant=tenant)
        principal = Principal(tenant=tenant, scopes=frozenset({"read", "write"}), api_key=key)
        user = User.objects.create_user("bench", password=uuid.uuid4().hex)
        membership_set_role(tenant=tenant, user=user, role="owner")
        start = timezone.now() - timedelta(seconds=1)
        before = _sizes()
        t0 = time.perf_counter()
        busy = generate(
            tenant, principal, live=live, ended=ended, ops=ops, episodes=episodes, jobs=args.jobs
        )
        gen_s = time.perf_counter() - t0
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE")
        after = _sizes()
        n_events = SandboxEvent.objects.count()
        n_ops = Operation.objects.count()
        n_sandboxes = Sandbox.objects.count()
        print(
            f"generated in {gen_s:.0f} s: {n_sandboxes} sandboxes ({live} live), {n_events} "
            f"ledger events, {n_ops} operations, {episodes} episodes",
            flush=True,
        )
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
        detail = busy.external_id if busy is not None else "sb-0000001"
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
                times, failure = await sample(client, path, n, **kw)
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
            t = time.perf_counter()
            report = audit_run(
                period_start=start,
                period_end=timezone.now(),
                audit_slice=AuditSlice(tenant=tenant),
                trigger="manual",
            )
            audits.append(time.perf_counter() - t)
        results.append(("team audit, whole history (in process)", audits, 2.0))
        print(f"\nrequests, sequential, {args.samples} each (goal: p95):")
        for name, times, goal in results:
            p95 = pct(times, 0.95)
            verdict = "met" if p95 <= goal else "MISSED"
            print(
                f"  {name:<42} p50 {pct(times, 0.5) * 1e3:8.1f} ms  p95 {p95 * 1e3:8.1f} ms  "
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
