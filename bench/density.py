"""Idle-sandbox density (issue 20): how many ready, idle sandboxes this machine holds and
what each costs, with the control plane configured as `make up` runs it.

    sudo .venv/bin/python -m bench.density 1000 [--concurrency 16]

Creates sandboxes (`host`, the defaults) through the REST API, each waited ready and
given one exec, until N are live or the first create fails (the limit hit, printed with
its error). Then, with all N live: machine memory per sandbox (MemAvailable and Slab
deltas ÷ N), the sandboxes' own processes by kind (PSS from smaps_rollup), the control
plane's RSS growth per sandbox, exec p50/p99 sampled across all of them, the sandbox
list's latency, and the time to delete them all; the leak audit at the end must balance.
Progress is printed every 100 sandboxes; Ctrl-C or a failure still removes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path

from bench._http import Client, TransportError
from bench._stack import make_up_settings, private_stack
from bench.lifecycle import _loop_factory, pct, reconcile_and_audit, settle

# The subnet `make up` claims (scripts/stack-defaults.env): a /21, 2045 sandboxes on
# four bridges of 512; the rest of the stack is configured by bench/_stack.py.
MAKE_UP_PREFIX = int(make_up_settings()["HEDGEROW_LOCAL_SUBNET_PREFIX"])


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def _pss_uss_kib(pid: int) -> tuple[int, int]:
    """(PSS, USS): proportional share, and the private pages only this process holds —
    what the machine gets back when it exits, the marginal cost of one more."""
    pss = uss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                uss += int(line.split()[1])
    except OSError:
        pass
    return pss, uss


def cgroup_charge_kib(instance: str) -> int:
    """What the memory cgroups of this instance's sandboxes are charged (v1
    memory.usage_in_bytes of each sandbox's group under ``hedgerow-<instance>``: its
    processes' pages, page cache and the kernel memory charged to them)."""
    total = 0
    for parent in Path("/sys/fs/cgroup/memory").rglob(f"hedgerow-{instance}"):
        for sandbox in parent.iterdir():
            usage = sandbox / "memory.usage_in_bytes"
            if sandbox.is_dir() and usage.exists():
                total += int(usage.read_text()) // 1024
    return total


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(root: int) -> int:
    """RSS of a process and its descendants (web's uvicorn workers, Celery's pool)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += _rss_kib(pid)
        todo.extend(children.get(pid, []))
    return total


def private_mappings(pid: int, top: int = 6) -> list[str]:
    """The mappings holding most of a process's private pages (where its USS is)."""
    sizes: Counter[str] = Counter()
    name = "?"
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split()
            if fields and "-" in fields[0] and ":" not in fields[0]:
                name = fields[5] if len(fields) > 5 else "[anon]"
            elif fields and fields[0] in ("Private_Dirty:", "Private_Clean:"):
                sizes[name] += int(fields[1])
    except OSError:
        return []
    return [f"{kib} KiB {where}" for where, kib in sizes.most_common(top)]


def sample_pid(instance: str, prefix: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                Path(entry, "comm").read_text().startswith(prefix)
                and instance in Path(entry, "cgroup").read_text()
            ):
                return int(entry.name)
        except OSError:
            continue
    return None


def sandbox_processes(instance: str) -> dict[str, tuple[int, int, int]]:
    """{kind: (processes, PSS KiB, USS KiB)} of every process in this instance's sandbox cgroups
    (memory controller), by command name."""
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            groups = Path(entry, "cgroup").read_text()
            comm = Path(entry, "comm").read_text().strip()
        except OSError:
            continue
        memory = next(
            (g for g in groups.splitlines() if ":memory:" in g or g.startswith("0::")), ""
        )
        if instance not in memory:
            continue
        kind = "agent (python3)" if comm.startswith("python") else comm
        found.setdefault(kind, []).append(int(entry.name))
    out = {}
    for kind, pids in found.items():
        sizes = [_pss_uss_kib(p) for p in pids]
        out[kind] = (len(pids), sum(a for a, _ in sizes), sum(b for _, b in sizes))
    return out


class Run:
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.ready_s: list[float] = []
        self.first_failure: str | None = None


async def create_one(client: Client, run: Run, n: int, started: float) -> None:
    if run.first_failure is not None:
        return
    t0 = time.perf_counter()
    try:
        created = await client.request(
            "POST",
            "/sandboxes",
            json={"image": "host"},
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        if created.status_code not in (200, 201):
            raise RuntimeError(f"create {created.status_code}: {created.text[:300]}")
        sandbox_id = created.json()["id"]
        run.ids.append(sandbox_id)
        waited = await client.request(
            "GET", f"/sandboxes/{sandbox_id}/wait", params={"timeout": 300}
        )
        body = waited.json() if waited.status_code == 200 else {}
        if body.get("state") != "ready":
            raise RuntimeError(f"wait {waited.status_code}: {waited.text[:300]}")
        ran = await client.request(
            "POST", f"/sandboxes/{sandbox_id}/exec", json={"command": "true"}
        )
        if ran.status_code != 200 or ran.json().get("exit_code") != 0:
            raise RuntimeError(f"exec {ran.status_code}: {ran.text[:300]}")
        run.ready_s.append(time.perf_counter() - t0)
        done = len(run.ready_s)
        if done % 100 == 0 or done == n:
            print(f"  {done} ready ({time.perf_counter() - started:.1f} s)", flush=True)
    except (RuntimeError, TransportError, ValueError, KeyError) as exc:
        if run.first_failure is None:
            run.first_failure = f"after {len(run.ready_s)} ready: {exc}"


async def fill(client: Client, n: int, concurrency: int) -> Run:
    run, gate, started = Run(), asyncio.Semaphore(concurrency), time.perf_counter()

    async def gated() -> None:
        async with gate:
            await create_one(client, run, n, started)

    await asyncio.gather(*(gated() for _ in range(n)))
    return run


async def sample_execs(client: Client, ids: list[str], samples: int) -> list[float]:
    out = []
    for sandbox_id in random.choices(ids, k=samples):
        t0 = time.perf_counter()
        ran = await client.request(
            "POST", f"/sandboxes/{sandbox_id}/exec", json={"command": "true"}
        )
        if ran.status_code == 200:
            out.append(time.perf_counter() - t0)
    return out


async def sample_list(client: Client, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        listed = await client.request("GET", "/sandboxes", params={"state": "ready", "limit": 50})
        if listed.status_code == 200:
            out.append(time.perf_counter() - t0)
    return out


async def delete_all(client: Client, ids: list[str], concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(sandbox_id: str) -> None:
        async with gate:
            try:
                await client.request("DELETE", f"/sandboxes/{sandbox_id}")
            except TransportError:
                pass

    await asyncio.gather(*(one(i) for i in ids))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=1000)
    parser.add_argument("--concurrency", type=int, default=16, help="creates in flight")
    parser.add_argument("--exec-samples", type=int, default=300)
    parser.add_argument(
        "--subnet-prefix",
        type=int,
        default=MAKE_UP_PREFIX,
        help="the prefix of the subnet the instance claims (make up: 21, 2045 sandboxes)",
    )
    parser.add_argument(
        "--bridge-ports",
        type=int,
        default=1023,
        help="ports per bridge (HEDGEROW_LOCAL_BRIDGE_PORTS): lower to cross bridges with few",
    )
    args = parser.parse_args()

    env = {
        "HEDGEROW_MAX_LIVE_SANDBOXES": "0",
        "HEDGEROW_LOCAL_SUBNET_PREFIX": str(args.subnet_prefix),
        "HEDGEROW_LOCAL_BRIDGE_PORTS": str(args.bridge_ports),
    }
    # The stack's configuration is printed by bench/_stack.py once it is up.
    print(
        f"bridges of {args.bridge_ports} ports at most; "
        f"N={args.n}, {args.concurrency} creates in flight; load average "
        f"{Path('/proc/loadavg').read_text().split()[0]}"
    )
    with private_stack("dn", env) as (stack, secret):
        from django.utils import timezone

        instance = os.environ["HEDGEROW_INSTANCE"]
        roots = {"web": stack.web.popen.pid, "worker": stack.worker.popen.pid}
        since = timezone.now()
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            client = Client(stack.url + "/api/v1", headers={"Authorization": f"Bearer {secret}"})
            # one sandbox first, so the zygote and both processes' caches are warm and
            # the deltas below are per-sandbox costs, not start-up costs
            warm = runner.run(fill(client, 1, 1))
            if warm.first_failure:
                raise SystemExit(f"the first sandbox failed: {warm.first_failure}")
            base_mem, base_cp = meminfo(), {k: tree_rss_kib(p) for k, p in roots.items()}
            base_procs = sandbox_processes(instance)
            base_charge = cgroup_charge_kib(instance)
            t0 = time.perf_counter()
            run = runner.run(fill(client, args.n, args.concurrency))
            fill_s = time.perf_counter() - t0
            try:
                live = len(run.ready_s)
                mem, cp = meminfo(), {k: tree_rss_kib(p) for k, p in roots.items()}
                procs = sandbox_processes(instance)
                charge = cgroup_charge_kib(instance)
                agent = sample_pid(instance, "hedgerow-agent")
                where = private_mappings(agent) if agent else []
                execs = runner.run(sample_execs(client, run.ids, args.exec_samples))
                listing = runner.run(sample_list(client, 50))
            finally:
                t1 = time.perf_counter()
                runner.run(delete_all(client, run.ids + warm.ids, args.concurrency))
                deleted_s = settle(600) - t1
                runner.run(client.aclose())
        reconcile, audit = reconcile_and_audit(since)

    per = max(live, 1)
    avail = (base_mem["MemAvailable"] - mem["MemAvailable"]) / per
    slab = (
        (mem["SUnreclaim"] + mem["SReclaimable"])
        - (base_mem["SUnreclaim"] + base_mem["SReclaimable"])
    ) / per
    print(f"\nlive idle sandboxes: {live} of {args.n} in {fill_s:.1f} s")
    print(f"first limit hit: {run.first_failure or 'none (N reached)'}")
    print(
        f"create → ready + 1 exec: p50 {pct(run.ready_s, 0.50):.2f} s, "
        f"p99 {pct(run.ready_s, 0.99):.2f} s"
    )
    print(f"machine memory per sandbox (MemAvailable delta / N): {avail / 1024:.2f} MiB")
    print(f"  of which kernel slab: {slab / 1024:.2f} MiB")
    print(
        f"  charged to the sandboxes' memory cgroups: {(charge - base_charge) / per / 1024:.2f} MiB"
    )
    for kind in sorted(set(procs) | set(base_procs)):
        n_now, pss_now, uss_now = procs.get(kind, (0, 0, 0))
        n_was, pss_was, uss_was = base_procs.get(kind, (0, 0, 0))
        print(
            f"  {kind}: {(n_now - n_was) / per:.2f} processes, "
            f"{(pss_now - pss_was) / per / 1024:.2f} MiB PSS, "
            f"{(uss_now - uss_was) / per / 1024:.2f} MiB USS per sandbox"
        )
    print(f"  one agent's private pages by mapping: {'; '.join(where)}")
    for name in roots:
        print(f"  control plane {name}: {(cp[name] - base_cp[name]) / per:.1f} KiB RSS per sandbox")
    print(
        f"exec (REST, sampled across all live, sequential): n={len(execs)} "
        f"p50 {pct(execs, 0.50) * 1000:.1f} ms, p99 {pct(execs, 0.99) * 1000:.1f} ms"
    )
    print(
        f"GET /sandboxes?state=ready&limit=50 with {live} live: "
        f"p50 {pct(listing, 0.50) * 1000:.1f} ms, p95 {pct(listing, 0.95) * 1000:.1f} ms"
    )
    print(f"delete all {live + 1}: {deleted_s:.1f} s until none is live")
    print(f"reconcile: {reconcile}")
    print(f"audit: {audit.summary if hasattr(audit, 'summary') else audit}")
    print(f"process kinds counted: {dict(Counter({k: v[0] for k, v in procs.items()}))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
