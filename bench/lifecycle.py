"""The sandbox lifecycle under load: N sandboxes concurrently through create → K execs
→ delete, all via the public REST API.

    .venv/bin/python -m bench.lifecycle N K [--concurrency C] [--web-workers W]
                                            [--worker-concurrency P]
                                            [--warm-pool M [--warm-pool-warming W]
                                             [--refill-quiet S] [--refill-after]]
                                            [--cpu-sampler light|off] [--subnet CIDR]

Boots its own stack (fresh database, Celery worker, uvicorn) under a private
HEDGEROW_INSTANCE, then runs N client tasks (at most C in flight). Each: POST
/sandboxes (Idempotency-Key), GET /wait (not when the create answered ``ready``: a
warm pool claim, create → ready is then the create's answer), K × POST /exec (`echo
<i>`, operation id), DELETE; 5xx answers are retried like the SDK does (same key /
operation id, counted). Reports success rate, end-to-end wall time, create-to-ready
and exec latency percentiles, commands per second, the control plane's peak memory
(RSS of the web and worker process trees, sampled every 250 ms), and, once every
sandbox is deleted, a reconciler round and the leak audit's equation (must show leaked
0, live 0), then where the machine's CPU went (bench/cpu_account.py; the first line
names the mode: ``--cpu-sampler off`` measures nothing per process inside the window).
The default subnet is sized from N and the pool (N + M sandboxes may be live at once).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apps.sandboxes.backends.local import idmap
from bench._http import Client, TransportError
from bench._stack import describe, make_up_settings, private_stack, set_arg
from bench.cpu_account import (
    CLIENT,
    MODES,
    NOT_OURS,
    WEB,
    WORKER,
    CpuAccount,
    Scope,
)


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, samples: list[float]) -> str:
    if not samples:
        return f"{name:<22} (no samples)"
    ms = [s * 1e3 for s in samples]
    return (
        f"{name:<22} p50 {pct(ms, 0.5):8.1f} ms   p95 {pct(ms, 0.95):8.1f} ms   "
        f"p99 {pct(ms, 0.99):8.1f} ms   mean {statistics.fmean(ms):8.1f} ms"
    )


@dataclass
class Results:
    ready: list[float] = field(default_factory=list)
    execs: list[float] = field(default_factory=list)
    lifecycles: list[float] = field(default_factory=list)
    # per operation kind (one request each, retries included): issue 17 goal 5
    creates: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    deletes: list[float] = field(default_factory=list)
    # when (perf_counter) each sandbox became ready / its delete was answered: the curve
    ready_at: list[float] = field(default_factory=list)
    deleted_at: list[float] = field(default_factory=list)
    # when (perf_counter) each create was answered: the first seconds of a burst
    answered_at: list[float] = field(default_factory=list)
    requests: int = 0  # answered requests, retries included
    ok: int = 0
    retries: int = 0
    reconnects: int = 0
    failures: list[str] = field(default_factory=list)


def _tree_rss_kib(pid: int) -> int:
    """RSS of a process and all its descendants (web workers, Celery pool children)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                for row in f:
                    if row.startswith("VmRSS:"):
                        total += int(row.split()[1])
            with open(f"/proc/{current}/task/{current}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


class MemorySampler(threading.Thread):
    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak_kib, self.running = pids, 0, True
        self.cpu = 0.0  # this thread's own CPU: measurement, not load

    def run(self) -> None:
        started = time.thread_time()
        while self.running:
            self.peak_kib = max(self.peak_kib, sum(_tree_rss_kib(p) for p in self.pids))
            self.cpu = time.thread_time() - started
            time.sleep(0.25)


async def _call(client: Any, results: Results, method: str, url: str, **kw: Any) -> Any:
    """What a careful client (the SDK) does: retry 5xx and transport errors a few times
    with the same Idempotency-Key / operation id, so a retry never creates or runs
    twice. Every retry is counted and reported."""
    for attempt in range(4):
        try:
            response = await client.request(method, url, **kw)
            results.requests += 1
            if response.status_code < 500 or attempt == 3:
                return response
        except TransportError:
            if attempt == 3:
                raise
        results.retries += 1
        await asyncio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


async def one_lifecycle(
    client: Any, k: int, results: Results, gate: asyncio.Semaphore, image: str = "host"
) -> None:
    async with gate:
        start = time.perf_counter()
        sandbox_id = None
        try:
            key = uuid.uuid4().hex
            t0 = time.perf_counter()
            created = await _call(
                client,
                results,
                "POST",
                "/sandboxes",
                json={"image": image},
                headers={"Idempotency-Key": key},
            )
            results.creates.append(time.perf_counter() - t0)
            results.answered_at.append(time.perf_counter())
            if created.status_code not in (200, 201):
                raise RuntimeError(f"create {created.status_code}: {created.text[:200]}")
            body = created.json()
            sandbox_id = body["id"]
            # A warm pool claim is answered ``ready``: as the SDK, no /wait round trip.
            if body.get("state") != "ready":
                t0 = time.perf_counter()
                waited = await client.request(
                    "GET", f"/sandboxes/{sandbox_id}/wait", params={"timeout": 300}
                )
                results.requests += 1
                results.waits.append(time.perf_counter() - t0)
                if waited.status_code != 200:
                    raise RuntimeError(f"wait {waited.status_code}: {waited.text[:200]}")
            results.ready_at.append(time.perf_counter())
            results.ready.append(results.ready_at[-1] - start)
            for i in range(k):
                t0 = time.perf_counter()
                ran = await _call(
                    client,
                    results,
                    "POST",
                    f"/sandboxes/{sandbox_id}/exec",
                    json={"command": f"echo {i}", "operation_id": f"op-{i}"},
                )
                body = ran.json()
                if ran.status_code != 200 or body.get("stdout") != f"{i}\n":
                    # The operation's error names the cause (its head is the same for all).
                    why = body.get("error") or ran.text[:200]
                    raise RuntimeError(f"exec {ran.status_code}: {why}")
                results.execs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            deleted = await _call(client, results, "DELETE", f"/sandboxes/{sandbox_id}")
            results.deletes.append(time.perf_counter() - t0)
            if deleted.status_code != 202:
                raise RuntimeError(f"delete {deleted.status_code}: {deleted.text[:200]}")
            results.deleted_at.append(time.perf_counter())
            results.lifecycles.append(results.deleted_at[-1] - start)
            results.ok += 1
        except (RuntimeError, TransportError, ValueError) as exc:
            results.failures.append(f"{type(exc).__name__}: {exc}")
            if sandbox_id is not None:  # a failed lifecycle still cleans up after itself
                try:
                    await client.request("DELETE", f"/sandboxes/{sandbox_id}")
                except TransportError:
                    pass


class HttpxClient:
    """The previous load generator (httpx), kept to compare what the client costs."""

    def __init__(self, base_url: str, headers: dict[str, str], concurrency: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(600.0, connect=60.0),
            limits=limits,
            trust_env=False,
        )
        self.reconnects = 0

    async def request(self, method: str, url: str, **kw: Any) -> Any:
        import httpx

        try:
            return await self._client.request(method, url, **kw)
        except httpx.TransportError as exc:
            raise TransportError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


async def run_load(
    url: str,
    secret: str,
    n: int,
    k: int,
    concurrency: int,
    use_httpx: bool = False,
    image: str = "host",
) -> Results:
    results = Results()
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {secret}"}
    client: Any = (
        HttpxClient(url + "/api/v1", headers, concurrency)
        if use_httpx
        else Client(url + "/api/v1", headers=headers)
    )
    try:
        await asyncio.gather(*(one_lifecycle(client, k, results, gate, image) for _ in range(n)))
    finally:
        await client.aclose()
        results.reconnects = client.reconnects
    return results


def settle(timeout: float = 300) -> float:
    """Waits until nothing is live any more; returns when (perf_counter)."""
    from apps.sandboxes.models import LIVE_STATES, Sandbox

    deadline = time.monotonic() + timeout
    while Sandbox.objects.filter(state__in=LIVE_STATES).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return time.perf_counter()


def reconcile_and_audit(since: Any) -> tuple[Any, Any]:
    from django.utils import timezone

    from apps.sandboxes.services.audit import audit_run
    from apps.sandboxes.services.reconcile import sandbox_reconcile

    reconcile = sandbox_reconcile()
    audit = audit_run(period_start=since, period_end=timezone.now(), trigger="manual")
    return reconcile, audit


def _loop_factory() -> Any:
    try:
        import uvloop  # with uvicorn[standard]; the cheaper loop for the load generator

        return uvloop.new_event_loop
    except ImportError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=1000)
    parser.add_argument("k", type=int, nargs="?", default=4)
    parser.add_argument("--concurrency", type=int, default=0, help="in flight; 0 = N")
    make_up_cfg = make_up_settings()
    parser.add_argument(
        "--web-workers",
        type=int,
        default=int(make_up_cfg["HEDGEROW_WEB_WORKERS"]),
        help="default: make up's (scripts/stack-defaults.env)",
    )
    parser.add_argument(
        "--worker-concurrency",
        type=int,
        default=int(make_up_cfg["HEDGEROW_WORKER_CONCURRENCY"]),
        help="default: make up's",
    )
    parser.add_argument(
        "--image",
        default="host",
        help="the image every create asks for: host (default), or an OCI reference "
        "(pulled once before the clock starts, so the run measures warm creates)",
    )
    parser.add_argument(
        "--httpx", action="store_true", help="the previous, costlier load generator (httpx)"
    )
    parser.add_argument(
        "--db-pool",
        type=int,
        default=int(make_up_cfg["HEDGEROW_DB_POOL_MAX"]),
        help="per web worker; default: make up's",
    )
    parser.add_argument(
        "--subnet",
        default="",
        help="the local backend's subnet; default: make up's size (a /21), larger if N "
        "and --warm-pool need it, in 10.214.0.0/16, chosen from the pid",
    )
    parser.add_argument(
        "--cpu-sampler",
        choices=MODES,
        default="light",
        help="light: sample the zygote's and worker pool's children in the window to "
        "split the sandbox side by process kind; off: no per-process sampling in the "
        "window (totals from /proc snapshots before and after; for headline figures)",
    )
    parser.add_argument(
        "--ready-curve",
        default=str(Path(tempfile.gettempdir()) / "hedgerow-lifecycle-ready.png"),
        help="where to write the ready curve (PNG: sandboxes ready and deletes answered "
        "over the run's time); docs/figures/lifecycle-ready.png is the one the docs show",
    )
    parser.add_argument(
        "--warm-pool",
        type=int,
        default=0,
        help="keep this many started sandboxes of the run's shape (warm pool); the run "
        "starts once they are all warm, and the prewarm is reported apart",
    )
    parser.add_argument(
        "--warm-pool-warming",
        type=int,
        default=4,
        help="members starting at once (HEDGEROW_WARM_POOL_MAX_WARMING), prewarm and refill",
    )
    parser.add_argument(
        "--refill-quiet",
        type=float,
        default=None,
        help="HEDGEROW_WARM_POOL_REFILL_QUIET_S (default: the setting's); 0 refills during "
        "the burst, as every claim did before the quiet period",
    )
    parser.add_argument(
        "--refill-after",
        action="store_true",
        help="after the window, wait until the pool is back at its target and report that "
        "refill's wall time and CPU (outside the window's figures)",
    )
    args = parser.parse_args()
    try:
        args.subnet = pick_subnet(
            args.subnet,
            needed_addresses(args.n, args.warm_pool),
            at_most=int(make_up_cfg["HEDGEROW_LOCAL_SUBNET_PREFIX"]),
        )
    except ValueError as exc:
        parser.error(str(exc))

    def configure(stack: Any) -> None:
        # make up's configuration is already set (bench/_stack.py); only what the
        # command line changed differs, and the printed configuration says so.
        set_arg(stack.web.args, "--workers", str(args.web_workers))
        stack.web.env["HEDGEROW_DB_POOL_MAX"] = str(args.db_pool)
        set_arg(stack.worker.args, "-c", str(args.worker_concurrency))

    env = {"HEDGEROW_MAX_LIVE_SANDBOXES": "0", "HEDGEROW_LOCAL_SUBNET": args.subnet}
    if args.warm_pool:
        # The shape every create of this run asks for ({"image": "host"}: the defaults).
        env["HEDGEROW_WARM_POOL"] = f"{pool_shape(args.image)}={args.warm_pool}"
        env["HEDGEROW_WARM_POOL_MAX_WARMING"] = str(args.warm_pool_warming)
        if args.refill_quiet is not None:
            env["HEDGEROW_WARM_POOL_REFILL_QUIET_S"] = str(args.refill_quiet)
    with private_stack("lc", env, configure) as (stack, secret):
        from django.utils import timezone

        assert stack.web.popen is not None and stack.worker.popen is not None
        stack_line = describe(stack).split(" — ")[-1]
        scope = Scope(
            roots={stack.web.popen.pid: WEB, stack.worker.popen.pid: WORKER},
            instance=os.environ["HEDGEROW_INSTANCE"],
            db_name=os.environ["HEDGEROW_DB_NAME"],
            zygote=_zygote_pid,
        )
        if args.image != "host":
            warm_image(args.image)
        prewarm = prewarm_pool(args.warm_pool, scope, args.cpu_sampler) if args.warm_pool else None
        sampler = MemorySampler([stack.web.popen.pid, stack.worker.popen.pid])
        sampler.start()
        # The machine is shared: record how busy it was when the clock started.
        args.load_before = Path("/proc/loadavg").read_text().split()[0]
        since = timezone.now()
        pool_before = pool_counts()
        cpu = CpuAccount(scope, args.cpu_sampler)
        cpu.start()
        started = time.perf_counter()
        started_wall = time.time()
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            results = runner.run(
                run_load(
                    stack.url,
                    secret,
                    args.n,
                    args.k,
                    args.concurrency or args.n,
                    args.httpx,
                    args.image,
                )
            )
        wall = time.perf_counter() - started
        all_deleted = settle()
        pool_after = pool_counts()
        # Accounted up to here: the lifecycles, not the verification that follows.
        cpu.other_samplers_cpu = sampler.cpu
        cpu.stop()
        sampler.running = False
        after = (
            refill_after(args.warm_pool, scope) if args.warm_pool and args.refill_after else None
        )
        reconcile, audit = reconcile_and_audit(since)
        report(args, results, wall, all_deleted - started, sampler.peak_kib, reconcile, audit)
        print("\n".join(first_seconds(results, started, started_wall, since)))
        print("\n".join(cpu.report(args.n, "sandbox")))
        stack_cpu = sum(v for k, v in cpu.breakdown().items() if k not in (*NOT_OURS, CLIENT))
        print("\n".join(stress_report(results, wall, cpu.busy_s, stack_cpu, args.n)))
        title = (
            f"{args.n} lifecycles, K={args.k}, {args.concurrency or args.n} in flight, "
            f"load {args.load_before} at the start"
        )
        if args.ready_curve:
            write_ready_curve(
                Path(args.ready_curve),
                results,
                started,
                title=f"{title}: {wall:.1f} s, {stack_line}",
            )
            print(f"ready curve            {args.ready_curve}")
        if prewarm is not None:
            print("\n".join(pool_report(prewarm, pool_before, pool_after, after)))
    return 0


POOL_SHAPE = "host:1000m:1024Mi:none"


def warm_image(reference: str) -> None:
    """Pulls the run's image into the machine-wide store before the clock starts (a
    cold pull is bench/images.py's measurement, not this one's)."""
    from apps.sandboxes.backends import get_backend

    started = time.perf_counter()
    info = get_backend().pull_image(reference)
    print(f"image {reference}: {info.digest} pulled in {time.perf_counter() - started:.1f}s")


def pool_shape(image: str) -> str:
    """The warm pool shape of the run's creates ({"image": image}: the defaults)."""
    return POOL_SHAPE.replace("host", image, 1)


SUBNET_POOL = ipaddress.IPv4Network("10.214.0.0/16")


def needed_addresses(n: int, warm_pool: int) -> int:
    """Sandboxes that may be live at once: every one of the run (a DELETE answers
    before the destroy), plus, with a pool, all its members again (refill starts one
    per claim while the claimed ones still live)."""
    return n + warm_pool


def _prefix_for(needed: int, at_most: int = 24) -> int:
    """The longest prefix, ``at_most`` or shorter, holding ``needed`` sandboxes with
    25 % to spare (network, bridge and broadcast take 3 addresses)."""
    for prefix in range(at_most, 15, -1):
        if 2 ** (32 - prefix) - 3 >= needed * 1.25:
            return prefix
    raise ValueError(f"{needed} live sandboxes do not fit in a /16")


def _routed() -> list[ipaddress.IPv4Network]:
    """Networks routed on this host (other instances' bridges among them)."""
    out = []
    try:
        with open("/proc/net/route") as f:
            next(f)
            for row in f:
                cols = row.split()
                dest, mask = (int(cols[i], 16).to_bytes(4, "little") for i in (1, 7))
                net = ipaddress.IPv4Network(
                    (ipaddress.IPv4Address(dest), str(ipaddress.IPv4Address(mask))),
                    strict=False,
                )
                if net.prefixlen:
                    out.append(net)
    except (OSError, ValueError, StopIteration):
        pass
    return out


def pick_subnet(
    requested: str,
    needed: int,
    claims: Path = Path("/run/hedgerow/subnets"),
    at_most: int = 24,
) -> str:
    """``requested`` if it is large enough (else ValueError, before anything starts);
    by default a subnet of ``_prefix_for(needed, at_most)`` in 10.214.0.0/16, the first
    free one from an offset derived from the pid, so concurrent runs do not collide."""
    if requested:
        net = ipaddress.IPv4Network(requested)
        if net.num_addresses - 3 < needed:
            raise ValueError(
                f"--subnet {net} holds {max(net.num_addresses - 3, 0)} sandboxes; this run may "
                f"have {needed} live at once: use a /{_prefix_for(needed)} or larger"
            )
        return str(net)
    prefix = _prefix_for(needed, at_most)
    candidates = list(SUBNET_POOL.subnets(new_prefix=prefix))
    used = _routed()
    taken = {p.name for p in claims.iterdir()} if claims.is_dir() else set()
    offset = os.getpid() % len(candidates)
    for i in range(len(candidates)):
        net = candidates[(offset + i) % len(candidates)]
        if str(net.network_address) in taken or any(net.overlaps(u) for u in used):
            continue
        if claims.is_dir() and not idmap.blocks_free(claims, net):
            continue  # its uid ranges are another claimed subnet's: the backend refuses it
        return str(net)
    raise ValueError(f"no free /{prefix} in {SUBNET_POOL} for {needed} sandboxes: pass --subnet")


def _zygote_pid() -> int | None:
    """The pid of this instance's agent zygote (it answers a ping), or None."""
    from django.conf import settings

    from apps.sandboxes.backends.local.zygote import ZygoteClient

    state_dir = Path(settings.STATE_DIR) / "sandboxes" / settings.HEDGEROW_INSTANCE
    runtime = Path("/run/hedgerow")  # only ping() is used: no link is made
    answer = ZygoteClient(state_dir, Path(settings.BASE_DIR) / "podagent", runtime).ping()
    return int(answer["pid"]) if answer else None


def pool_counts() -> dict[str, int]:
    """Members now (warm, warming), claims and members started so far (ledger + rows)."""
    from apps.sandboxes.models import SandboxEvent, WarmMember, WarmMemberState
    from apps.sandboxes.services.warm_pool import CLAIM_REASON, warm_pool_stats

    stats = warm_pool_stats()  # Redis counters; claims are the ledger's (as /metrics folds them)
    claims = SandboxEvent.objects.filter(event="transition", reason=CLAIM_REASON).count()
    warm = WarmMember.objects.filter(state=WarmMemberState.WARM).count()
    warming = WarmMember.objects.filter(state=WarmMemberState.WARMING).count()
    return {
        "warm": warm,
        "warming": warming,
        "claims": claims,
        "misses": int(stats.get("misses", 0)),
        "discards": int(stats.get("discards", 0)),
        "failures": int(stats.get("failures", 0)),
    }


@dataclass
class Prewarm:
    members: int
    wall: float
    cpu_lines: list[str]
    cpu_per_member_ms: float


def prewarm_pool(n: int, scope: Scope, mode: str) -> Prewarm:
    """Fills the pool before the clock starts, measuring what it cost: the refill the
    run does later costs the same per member and lands inside the measured window."""
    from apps.sandboxes.models import WarmMember, WarmMemberState
    from apps.sandboxes.services.warm_pool import warm_pool_refill

    cpu = CpuAccount(scope, mode)
    cpu.start()
    started = time.perf_counter()
    deadline = time.monotonic() + 60 + n
    while WarmMember.objects.filter(state=WarmMemberState.WARM).count() < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"warm pool did not reach {n} members")
        warm_pool_refill()  # no beat in the bench stack: this is its refill tick
        time.sleep(0.5)
    wall = time.perf_counter() - started
    cpu.stop()
    ours = sum(v for k, v in cpu.breakdown().items() if k not in (*NOT_OURS, CLIENT))
    return Prewarm(n, wall, cpu.report(n, "member"), 1e3 * ours / n)


@dataclass
class RefillAfter:
    members: int  # started after the window
    wall: float  # from the window's end until the pool was back at its target
    cpu_s: float  # this stack's CPU in that time
    cpu_lines: list[str]


def refill_after(target: int, scope: Scope) -> RefillAfter:
    """The refill the window left to do: from the window's end until the pool is back
    at its target (the refill checks the claims enqueued run it, as in production;
    the bench stack has no beat), with this stack's CPU in that time."""
    from apps.sandboxes.models import WarmMember, WarmMemberState

    at_end = pool_counts()
    cpu = CpuAccount(scope)
    cpu.start()
    started = time.perf_counter()
    deadline = time.monotonic() + 120 + target
    while WarmMember.objects.filter(state=WarmMemberState.WARM).count() < target:
        if time.monotonic() > deadline:
            print(f"warm pool not back at {target} members after the window")
            break
        time.sleep(0.25)
    wall = time.perf_counter() - started
    cpu.stop()
    ours = sum(v for k, v in cpu.breakdown().items() if k not in (*NOT_OURS, CLIENT))
    members = max(0, target - at_end["warm"] - at_end["warming"]) + at_end["warming"]
    return RefillAfter(members, wall, ours, cpu.report(max(members, 1), "member"))


def pool_report(
    prewarm: Prewarm,
    before: dict[str, int],
    after: dict[str, int],
    refill: RefillAfter | None = None,
) -> list[str]:
    claims = after["claims"] - before["claims"]
    members_before = before["warm"] + before["warming"]
    members_after = after["warm"] + after["warming"]
    # Every member started in the window either was claimed in it or is still here.
    refilled = members_after + claims - members_before
    refilled += after["failures"] - before["failures"] + after["discards"] - before["discards"]
    lines = [
        f"warm pool              {prewarm.members} members prewarmed in {prewarm.wall:.1f} s "
        f"before the clock, {prewarm.cpu_per_member_ms:.1f} ms of this stack's CPU per member",
        f"                       in the measured window: {claims} claims, "
        f"{after['misses'] - before['misses']} misses, "
        f"{after['discards'] - before['discards']} discarded, {refilled} members started "
        f"by refill (≈ {refilled * prewarm.cpu_per_member_ms / 1e3:.1f} s CPU, already in "
        "the figures above); "
        f"pool at the end: {after['warm']} warm, {after['warming']} warming",
        "prewarm CPU breakdown:",
        *("  " + line for line in prewarm.cpu_lines),
    ]
    if refill is not None:
        per = 1e3 * refill.cpu_s / refill.members if refill.members else 0.0
        lines += [
            f"refill after the window {refill.members} members (incl. those warming at its "
            f"end) back in {refill.wall:.1f} s after the window, {refill.cpu_s:.1f} s of this "
            f"stack's CPU ({per:.1f} ms per member), not in the figures above",
            "refill-after CPU breakdown:",
            *("  " + line for line in refill.cpu_lines),
        ]
    return lines


def report(
    args: argparse.Namespace,
    results: Results,
    wall: float,
    until_deleted: float,
    peak_kib: int,
    reconcile: Any,
    audit: Any,
) -> None:
    n, k = args.n, args.k
    load_before = getattr(args, "load_before", "?")
    out = [
        f"lifecycle: N={n} K={k} concurrency={args.concurrency or n} "
        f"web-workers={args.web_workers} worker-concurrency={args.worker_concurrency} "
        f"db-pool={args.db_pool} cpus={os.cpu_count()} load-before={load_before} "
        f"subnet={args.subnet}",
        f"success                {results.ok}/{n} ({100.0 * results.ok / n:.1f}%), "
        f"client retries {results.retries}, reconnects {results.reconnects}",
        f"wall time              {wall:.2f} s (first create → last delete accepted)",
        f"                       {until_deleted:.2f} s (first create → every sandbox deleted)",
        line("create→ready", results.ready),
        line("exec (echo)", results.execs),
        line("whole lifecycle", results.lifecycles),
        f"commands/s             {len(results.execs) / wall:.1f}",
        f"peak control-plane RSS {peak_kib / 1024:.0f} MiB (web + worker trees)",
        f"reconcile              skipped={reconcile.skipped} actions={reconcile.actions}",
        f"audit                  {audit.report.get('equation')}",
        f"                       orphaned={audit.orphaned} balanced={audit.balanced}",
    ]
    if results.failures:
        out.append(f"first failures: {results.failures[:5]}")
    print("\n".join(out))


def first_seconds(results: Results, started: float, started_wall: float, since: Any) -> list[str]:
    """When the burst's milestones happened, in seconds after the first create was sent:
    create answered (client), create committed (the ledger's ``created``), provision
    started (``provisioning``: a worker took the task), ready (``ready``), and the
    client seeing it ready. Why the ready curve starts late is in which column lags."""
    from apps.sandboxes.models import SandboxEvent, State

    def rel_ledger(**kw: Any) -> list[float]:
        ats = SandboxEvent.objects.filter(at__gte=since, **kw).values_list("at", flat=True)
        return sorted(at.timestamp() - started_wall for at in ats)

    columns = [
        ("create answered", sorted(t - started for t in results.answered_at)),
        ("create committed", rel_ledger(event="created")),
        ("provision started", rel_ledger(to_state=State.PROVISIONING)),
        ("ready (ledger)", rel_ledger(to_state=State.READY)),
        ("ready (client)", sorted(t - started for t in results.ready_at)),
    ]
    marks = (1, 10, 100)
    head = "first seconds (s after the first create was sent; the nth of each)"
    out = [
        head,
        f"  {'milestone':<18}"
        + "".join(f"{'#' + str(m):>8}" for m in marks)
        + "      by 2 s   by 5 s  by 10 s",
    ]
    for name, times in columns:
        nth = "".join(f"{times[m - 1]:8.2f}" if len(times) >= m else f"{'-':>8}" for m in marks)
        by = "".join(f"{sum(1 for t in times if t <= s):9d}" for s in (2, 5, 10))
        out.append(f"  {name:<18}{nth}{by}")
    # How long a provision took (provisioning → ready, the worker's part), in the order
    # the provisions started: the first ones of a fresh instance make its bridges.
    spans: dict[Any, dict[str, float]] = {}
    rows = SandboxEvent.objects.filter(
        at__gte=since, to_state__in=[State.PROVISIONING, State.READY]
    ).values_list("sandbox_id", "to_state", "at")
    for sandbox_id, to_state, at in rows:
        spans.setdefault(sandbox_id, {})[str(to_state)] = at.timestamp()
    took = [
        (v[State.PROVISIONING], v[State.READY] - v[State.PROVISIONING])
        for v in spans.values()
        if State.PROVISIONING in v and State.READY in v
    ]
    took.sort()
    if took:
        durations = [d for _, d in took]
        out.append(
            "  provision took     first 4: "
            + " ".join(f"{d:.2f}" for d in durations[:4])
            + f" s; p50 {pct(durations, 0.5):.2f} s, p99 {pct(durations, 0.99):.2f} s"
        )
    return out


def stress_report(
    results: Results, wall: float, machine_cpu_s: float, stack_cpu_s: float, n: int
) -> list[str]:
    """What the seeds ask of a stress test (issue 17 goal 5): the rate of answered
    requests, p50/p99 per operation kind, the validity rate η (lifecycles that ran
    through with every answer as expected, of those started) and the cost per valid
    lifecycle: the machine's CPU (every process: on a shared machine others' too) and
    this stack's own (web, worker, sandboxes, Postgres; not the load generator)."""
    eta = results.ok / n if n else 0.0
    kinds = (
        ("create", results.creates),
        ("wait", results.waits),
        ("exec", results.execs),
        ("delete", results.deletes),
    )
    out = [
        f"stress (goal 5)        {results.requests / wall:.1f} requests/s answered "
        f"({results.requests} in {wall:.2f} s), η = {eta:.3f} ({results.ok}/{n} valid), "
        + (
            f"per valid lifecycle {1e3 * machine_cpu_s / results.ok:.1f} ms of machine CPU, "
            f"{1e3 * stack_cpu_s / results.ok:.1f} ms of this stack's"
            if results.ok
            else "no valid lifecycle"
        )
    ]
    for name, samples in kinds:
        if samples:
            ms = [s * 1e3 for s in samples]
            out.append(
                f"  {name:<8} {len(ms):6d} requests   p50 {pct(ms, 0.5):8.1f} ms   "
                f"p99 {pct(ms, 0.99):8.1f} ms"
            )
    return out


def ready_curve(results: Results, started: float) -> tuple[list[float], list[float]]:
    """Seconds from the first create at which each sandbox became ready and each
    delete was answered, in order (the curves' x values; y is 1..len)."""
    return (
        sorted(t - started for t in results.ready_at),
        sorted(t - started for t in results.deleted_at),
    )


def write_ready_curve(path: Path, results: Results, started: float, title: str) -> None:
    """A PNG of sandboxes ready (and deletes answered) over the run's time, with the
    create→ready percentiles marked: a burst whose last sandboxes straggle shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ready, deleted = ready_curve(results, started)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.step(ready, range(1, len(ready) + 1), where="post", label="ready (create → ready)")
    ax.step(deleted, range(1, len(deleted) + 1), where="post", label="delete answered")
    ms = [s * 1e3 for s in results.ready]
    if ms:
        ax.text(
            0.01,
            0.97,
            f"create→ready p50 {pct(ms, 0.5) / 1e3:.2f} s · p95 {pct(ms, 0.95) / 1e3:.2f} s"
            f" · p99 {pct(ms, 0.99) / 1e3:.2f} s (each from its own create)",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
        )
    ax.set_xlabel("seconds since the first create")
    ax.set_ylabel("sandboxes")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
