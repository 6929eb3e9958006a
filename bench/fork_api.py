"""A fork through the whole control plane: ``POST /snapshots/{id}/fork`` of K children
of a sandbox with ``--mib`` of changed state, until every child is ``ready`` (each
verified: tree, services, probes, ports, processes, environment), on a private stack
(its own database, web, Celery worker with 4 processes, instance).

    sudo .venv/bin/python -m bench.fork_api [--count 64] [--mib 0] [--cpu] [--profile N]

Prints the wall time
from the request to the last child ready, and where each child's time went from the
ledger (queued until its provision was claimed, then provisioning to ready). On a
shared machine compare runs taken together (docs/benchmarks.md).

``--cpu``: the exact CPU of the fork (request to last child ready) by process kind —
web, Celery worker, zygote and sandboxes, this run's Postgres backends — from two
``/proc`` snapshots (bench/cpu_account.py), so the figure means something on a shared
machine. ``--profile N``: afterwards, N more children are forked with their provision
run here, one after the other, under cProfile (the worker's code path, no Celery): the
control plane's own CPU per child by phase.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

from bench._stack import make_up_settings, private_stack
from bench.cpu_account import _TICK, CLIENT, NOT_OURS, WEB, WORKER, CpuAccount, Scope
from bench.lifecycle import _zygote_pid


def _wait(http: httpx.Client, path: str, until: tuple[str, ...], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        body = http.get(path).json()
        if body.get("state") in until:
            return body
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} still {body.get('state')} after {timeout}s")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--mib", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="exact CPU of the fork by process kind")
    p.add_argument(
        "--worker-concurrency",
        type=int,
        default=int(make_up_settings()["HEDGEROW_WORKER_CONCURRENCY"]),
        help="worker processes (default: make up's)",
    )
    p.add_argument("--profile", type=int, default=0, help="then profile N provisions in-process")
    args = p.parse_args()

    def configure(stack: Any) -> None:
        stack.worker.args[stack.worker.args.index("-c") + 1] = str(args.worker_concurrency)

    with private_stack("fk", {}, configure) as (stack, secret):
        http = httpx.Client(
            base_url=stack.url + "/api/v1",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=120,
            trust_env=False,
        )
        made = http.post("/sandboxes", json={"image": "host", "ttl_seconds": 3600})
        parent = made.json()["id"]
        _wait(http, f"/sandboxes/{parent}", ("ready",), 120)
        command = "echo state > /workspace/s"
        if args.mib:
            command += f" && head -c {args.mib << 20} /dev/urandom > /workspace/data.bin"
        ran = http.post(f"/sandboxes/{parent}/exec", json={"command": command, "timeout": 600})
        assert ran.json()["exit_code"] == 0, ran.text
        snap = http.post(
            f"/sandboxes/{parent}/snapshots",
            json={"probes": [{"name": "state", "command": "cat /workspace/s"}]},
        ).json()
        snap = _wait(http, f"/snapshots/{snap['id']}", ("ready", "failed"), 600)
        assert snap["state"] == "ready", snap
        cpu = None
        if args.cpu:
            assert stack.web.popen is not None and stack.worker.popen is not None
            scope = Scope(
                roots={stack.web.popen.pid: WEB, stack.worker.popen.pid: WORKER},
                instance=os.environ["HEDGEROW_INSTANCE"],
                db_name=os.environ["HEDGEROW_DB_NAME"],
                zygote=_zygote_pid,
            )
            cpu = CpuAccount(scope, "off")
            cpu.start()
        load = Path("/proc/loadavg").read_text().split()[0]
        t0 = time.perf_counter()
        forked = http.post(f"/snapshots/{snap['id']}/fork", json={"count": args.count})
        assert forked.status_code == 201, forked.text
        answered = time.perf_counter() - t0
        ids = [c["id"] for c in forked.json()["sandboxes"]]
        # the database (what the API answers from), one query per 25 ms: polling 64
        # sandboxes through the web would put the poller's load into the figure
        from apps.sandboxes.models import Sandbox

        children = Sandbox.objects.filter(external_id__in=ids)
        deadline = time.monotonic() + 600
        while children.exclude(state__in=("ready", "failed")).exists():
            if time.monotonic() > deadline:
                raise SystemExit("children not settled after 600 s")
            time.sleep(0.025)
        wall = time.perf_counter() - t0
        states = [c.state for c in children]
        if cpu is not None:
            cpu.stop()
        from apps.sandboxes.models import SandboxEvent

        waits, provisions = [], []
        for sandbox_id in ids:
            moves = {
                e.to_state: e.at
                for e in SandboxEvent.objects.filter(
                    sandbox__external_id=sandbox_id, event__in=("created", "transition")
                )
            }
            waits.append((moves["provisioning"] - moves["requested"]).total_seconds())
            provisions.append((moves["ready"] - moves["provisioning"]).total_seconds())
        print(
            f"fork {args.count} ({args.mib} MiB): {wall:.2f} s to all "
            f"ready (request answered in {answered:.2f} s); "
            f"{states.count('ready')} ready, {states.count('failed')} failed; "
            f"per child: wait for a provision slot median {statistics.median(waits):.2f} s "
            f"(max {max(waits):.2f}), provisioning→ready (restore + verification) "
            f"median {statistics.median(provisions):.2f} s (max {max(provisions):.2f}); "
            f"load average {load} at the start"
        )
        if cpu is not None:
            parts = cpu.breakdown()
            ours = {k: v for k, v in parts.items() if k not in NOT_OURS and v != 0}
            poller = ours.pop(CLIENT, 0.0)  # this process: the fork request and the polling
            total = sum(ours.values())
            print(
                f"  CPU of the stack {total:.2f} s = {total / args.count * 1000:.0f} ms per child"
                f" (+ this bench's own {poller:.2f} s) ("
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ours.items(), key=lambda x: -x[1]))
                + f"); machine busy {cpu.busy_ticks / _TICK:.1f} s in {cpu.wall:.2f} s"
            )
        if args.profile:
            _profile(snap["id"], args.profile)


def _profile(snapshot_id: str, n: int) -> None:
    """N children forked here with their provisions run in this process, one at a time,
    under cProfile: what the worker's code path costs per child, by function."""
    from apps.sandboxes import tasks
    from apps.sandboxes.models import Snapshot
    from apps.sandboxes.services.provisioning import sandbox_provision
    from apps.sandboxes.services.snapshots import snapshot_fork

    snapshot = Snapshot.objects.get(pk=snapshot_id)
    queued: list[str] = []
    with mock.patch.object(tasks.provision_sandboxes, "delay", side_effect=queued.extend):
        prof = cProfile.Profile(time.process_time)  # CPU, not waits
        prof.enable()
        t0 = time.process_time()
        children, _ = snapshot_fork(
            tenant=snapshot.tenant, snapshot=snapshot, count=n, idempotency_key=None, actor="b"
        )
        admit = time.process_time() - t0
        t0 = time.process_time()
        assert sorted(queued) == sorted(str(c.id) for c in children)
        for sandbox_id in queued:
            sandbox_provision(sandbox_id=sandbox_id)
        provision = time.process_time() - t0
        prof.disable()
    print(
        f"  in-process, {n} children: fork request {admit / n * 1000:.1f} ms CPU per child, "
        f"provision + verification {provision / n * 1000:.1f} ms CPU per child "
        "(this process only; cProfile on)"
    )
    pstats.Stats(prof).sort_stats("cumulative").print_stats(60)


if __name__ == "__main__":
    main()
