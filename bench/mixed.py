"""A mixed real-size workload: does a short exec wait behind long commands and big
transfers (head-of-line blocking)? Issue 17 goals 4 and 5.

    .venv/bin/python -m bench.mixed [--sandboxes 200] [--bytes 200MB] [--seconds 60]
                                    [--long-seconds 30] [--short-clients 8]
                                    [--transfer-clients 4] [--stream-clients 4]

Boots its own stack the way `make up` starts it (2 web workers on uvloop/httptools,
HEDGEROW_DB_POOL=1, a 4-process Celery worker, the installation's default limits; the
configuration is printed first), creates N ``host`` sandboxes, then:

1. idle: short execs (``echo <token>``) one at a time across the sandboxes, then from
   ``--short-clients`` closed-loop clients (the load the mix puts on them), nothing
   else running: the baselines;
2. mixed, for ``--seconds``: at once, in every sandbox a long command (``sleep
   <long-seconds>``, a 60 s timeout: a *long* exec) over and over; short-exec clients;
   transfer clients each uploading ``--bytes`` to a sandbox (streamed from a generator,
   never held whole by the client) and downloading it back (counted, not kept);
   streamed execs (``stream: true`` then the websocket: 20 lines of output each);
   the transfer clients run in a process of their own (``--no-transfer-clients-process``:
   in this one, where their bytes delayed the short execs' answers on the client's loop);
   health checks every 0.5 s (``/healthz`` and ``GET /sandboxes/<id>`` of a random
   sandbox must answer 200 ``ready``).
3. every sandbox deleted, a reconciler round and the leak audit.

Reports QPS and p50/p99 per operation kind, 429s by the limit they name, failed health
checks, sandboxes that ended ``lost`` or ``failed``, the short-exec p99 ratio
mixed/idle (goal: ≤ 3), the validity rate η (sandboxes whose every operation in the
run answered correctly, over N), the cost per valid lifecycle (CPU seconds of this
stack's web and worker process trees, and of the whole machine, over the run, per
valid sandbox), and the peak RSS of the web and worker trees (sampled every 250 ms: a
transfer buffered whole would show as ``--bytes`` of RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import re
import statistics
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._http import Client, TransportError
from bench._stack import private_stack
from bench.lifecycle import (
    MemorySampler,
    _loop_factory,
    _tree_rss_kib,
    pick_subnet,
    reconcile_and_audit,
    settle,
)

CHUNK = 1024 * 1024
LINES = 20


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]i?B?|B)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 200MB, 20MiB)")
    unit = (match.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit]


@dataclass
class Kind:
    latencies: list[float] = field(default_factory=list)
    ok: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Run:
    kinds: dict[str, Kind] = field(default_factory=lambda: defaultdict(Kind))
    health_checks: int = 0
    health_failed: list[str] = field(default_factory=list)
    invalid: set[str] = field(default_factory=set)  # sandboxes with a wrong answer

    def refusal(self, kind: str, response: Any) -> bool:
        """A typed 429 is counted by the limit it names (admission working as
        designed, not a failure); True when it was one."""
        if response.status_code != 429:
            return False
        try:
            limit = response.json()["error"].get("limit") or response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            limit = "untyped"
        self.kinds[kind].refused[str(limit)] += 1
        return True

    def fail(self, kind: str, sandbox_id: str | None, why: str) -> None:
        self.kinds[kind].failed.append(why[:200])
        if sandbox_id:
            self.invalid.add(sandbox_id)


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat)."""
    cols = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [int(c) for c in cols]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """utime+stime of a process tree, reaped children included (cutime/cstime)."""
    total, stack, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while stack:
        current = stack.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in stat[11:15]) / tick
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
            stack.extend(int(c) for c in children)
        except (OSError, ValueError, IndexError):
            continue
    return total


def weigh_instance(shares: int) -> list[str]:
    """This instance's sandboxes' parent cpu cgroup(s) (every agent and command of the
    instance is under one: the kernel weighs it as a whole against each process
    outside, e.g. each web worker) given ``shares`` (v1 ``cpu.shares``, kernel default
    1024; v2 ``cpu.weight`` scaled, default 100). A benchmark knob, not the product's:
    the lab notes' "The sandboxes' cgroup against the machine" measured it. Returns
    the files written."""
    from django.conf import settings

    from apps.sandboxes.backends.local.cgroups import CgroupDriver

    instance = str(settings.HEDGEROW_INSTANCE)
    registry = Path(settings.STATE_DIR) / "sandboxes" / instance / "cgroups"
    written = []
    for _controller, parent in CgroupDriver(f"hedgerow-{instance}", registry).all_parents():
        if (parent / "cpu.shares").exists():
            (parent / "cpu.shares").write_text(str(shares))
            written.append(str(parent / "cpu.shares"))
        elif (parent / "cpu.weight").exists():
            (parent / "cpu.weight").write_text(str(max(1, min(10000, shares * 100 // 1024))))
            written.append(str(parent / "cpu.weight"))
    return written


async def create_all(client: Client, n: int, concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    ids: list[str] = []

    async def one() -> None:
        async with gate:
            created = await client.request(
                "POST",
                "/sandboxes",
                json={"image": "host"},
                headers={"Idempotency-Key": uuid.uuid4().hex},
            )
            if created.status_code not in (200, 201):
                raise SystemExit(f"create {created.status_code}: {created.text[:200]}")
            body = created.json()
            if body.get("state") != "ready":
                waited = await client.request(
                    "GET", f"/sandboxes/{body['id']}/wait", params={"timeout": 300}
                )
                if waited.status_code != 200:
                    raise SystemExit(f"wait {waited.status_code}: {waited.text[:200]}")
            ids.append(body["id"])

    await asyncio.gather(*(one() for _ in range(n)))
    return ids


async def short_exec(client: Client, run: Run, sandbox_id: str) -> None:
    token = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    try:
        response = await client.request(
            "POST",
            f"/sandboxes/{sandbox_id}/exec",
            json={"command": f"echo {token}", "timeout": 10},
        )
    except TransportError as exc:
        run.fail("short exec", sandbox_id, f"transport: {exc}")
        return
    if run.refusal("short exec", response):
        return
    if response.status_code != 200 or response.json().get("stdout") != f"{token}\n":
        run.fail("short exec", sandbox_id, f"{response.status_code}: {response.text[:150]}")
        return
    run.kinds["short exec"].latencies.append(time.perf_counter() - t0)
    run.kinds["short exec"].ok += 1


async def idle_baseline(
    client: Client, ids: list[str], samples: int, clients: int, seconds: float
) -> tuple[Run, Run]:
    """Short execs with nothing else running: ``samples`` one at a time, then
    ``clients`` closed-loop clients for ``seconds`` — the same short-exec load the mix
    runs, so the ratio isolates what the other kinds add."""
    one = Run()
    for i in range(samples):
        await short_exec(client, one, ids[i % len(ids)])
    same = Run()
    stop = time.monotonic() + seconds
    await asyncio.gather(*(short_loop(client, same, ids, stop) for _ in range(clients)))
    return one, same


async def long_loop(client: Client, run: Run, sandbox_id: str, seconds: int, stop: float) -> None:
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        try:
            response = await client.request(
                "POST",
                f"/sandboxes/{sandbox_id}/exec",
                json={"command": f"sleep {seconds}; echo done", "timeout": 60},
            )
        except TransportError as exc:
            run.fail("long exec", sandbox_id, f"transport: {exc}")
            return
        if run.refusal("long exec", response):
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
            continue
        if response.status_code != 200 or response.json().get("stdout") != "done\n":
            run.fail("long exec", sandbox_id, f"{response.status_code}: {response.text[:150]}")
            return
        run.kinds["long exec"].latencies.append(time.perf_counter() - t0)
        run.kinds["long exec"].ok += 1


async def short_loop(client: Client, run: Run, ids: list[str], stop: float) -> None:
    while time.monotonic() < stop:
        await short_exec(client, run, random.choice(ids))


async def _body(nbytes: int) -> AsyncIterator[bytes]:
    block = os.urandom(CHUNK)
    sent = 0
    while sent < nbytes:
        piece = block[: min(CHUNK, nbytes - sent)]
        sent += len(piece)
        yield piece


async def transfer_loop(
    http: Any, run: Run, ids: list[str], nbytes: int, stop: float, worker: int
) -> None:
    import httpx

    while time.monotonic() < stop:
        sandbox_id = random.choice(ids)
        url = f"/sandboxes/{sandbox_id}/files"
        path = {"path": f"/workspace/blob-{worker}.bin"}
        t0 = time.perf_counter()
        try:
            put = await http.put(
                url,
                params=path,
                content=_body(nbytes),
                headers={"Content-Length": str(nbytes)},
            )
            if run.refusal("upload", put):
                await asyncio.sleep(float(put.headers.get("retry-after", "1")))
                continue
            if put.status_code != 200 or put.json().get("size") != nbytes:
                run.fail("upload", sandbox_id, f"{put.status_code}: {put.text[:150]}")
                continue
            run.kinds["upload"].latencies.append(time.perf_counter() - t0)
            run.kinds["upload"].ok += 1
            run.kinds["upload"].nbytes += nbytes
            t0 = time.perf_counter()
            got = 0
            async with http.stream("GET", url, params=path) as response:
                if response.status_code == 429:
                    await response.aread()  # the typed error's body, to name the limit
                if run.refusal("download", response):
                    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                    continue
                async for chunk in response.aiter_raw(CHUNK):
                    got += len(chunk)
                status = response.status_code
            if status != 200 or got != nbytes:
                run.fail("download", sandbox_id, f"{status}: {got} of {nbytes} bytes")
                continue
            run.kinds["download"].latencies.append(time.perf_counter() - t0)
            run.kinds["download"].ok += 1
            run.kinds["download"].nbytes += got
        except httpx.HTTPError as exc:
            run.fail("upload", sandbox_id, f"{type(exc).__name__}: {exc}")


def _transfers_main(
    url: str, secret: str, ids: list[str], nbytes: int, stop_at: float, clients: int, out: Any
) -> None:
    """The transfer clients in a process of their own (``--transfer-clients-process``):
    their bytes (the client's upload generator, httpx's parsing of 200 MiB answers)
    then do not queue the short-exec clients' answers on this process's event loop, a
    confounder a real deployment does not have. Results go back through ``out``."""
    import httpx

    async def run_all() -> Run:
        run = Run()
        http = httpx.AsyncClient(
            base_url=url + "/api/v1",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(600.0),
            trust_env=False,
        )
        stop = time.monotonic() + (stop_at - time.time())
        try:
            await asyncio.gather(
                *(transfer_loop(http, run, ids, nbytes, stop, i) for i in range(clients))
            )
        finally:
            await http.aclose()
        return run

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        run = runner.run(run_all())
    out.put(
        (
            {
                name: (k.latencies, k.ok, dict(k.refused), k.failed, k.nbytes)
                for name, k in run.kinds.items()
            },
            sorted(run.invalid),
        )
    )


def _merge(run: Run, kinds: dict[str, Any], invalid: list[str]) -> None:
    for name, (latencies, ok, refused, failed, nbytes) in kinds.items():
        kind = run.kinds[name]
        kind.latencies += latencies
        kind.ok += ok
        kind.refused.update(refused)
        kind.failed += failed
        kind.nbytes += nbytes
    run.invalid.update(invalid)


async def stream_loop(
    client: Client, run: Run, ids: list[str], ws_base: str, auth: dict[str, str], stop: float
) -> None:
    from websockets.asyncio.client import connect

    command = f"for i in $(seq {LINES}); do echo line $i; done"
    expected = "".join(f"line {i}\n" for i in range(1, LINES + 1))
    while time.monotonic() < stop:
        sandbox_id = random.choice(ids)
        t0 = time.perf_counter()
        try:
            started = await client.request(
                "POST",
                f"/sandboxes/{sandbox_id}/exec",
                json={"command": command, "stream": True, "timeout": 10},
            )
            if run.refusal("streamed exec", started):
                continue
            if started.status_code not in (200, 201, 202):
                run.fail("streamed exec", sandbox_id, f"{started.status_code}: {started.text}")
                continue
            out, exit_code = [], None
            async with connect(
                ws_base + started.json()["stream_url"], additional_headers=auth
            ) as ws:
                async for message in ws:
                    frame = json.loads(message)
                    if frame["type"] == "exec.stdout":
                        out.append(base64.b64decode(frame["data"]))
                    elif frame["type"] == "exec.exit":
                        exit_code = (frame.get("result") or {}).get("exit_code")
                        break
        except (TransportError, OSError, ValueError, KeyError) as exc:
            run.fail("streamed exec", sandbox_id, f"{type(exc).__name__}: {exc}")
            continue
        if exit_code != 0 or b"".join(out).decode() != expected:
            run.fail("streamed exec", sandbox_id, f"exit {exit_code}, {len(out)} frames")
            continue
        run.kinds["streamed exec"].latencies.append(time.perf_counter() - t0)
        run.kinds["streamed exec"].ok += 1


async def health_loop(client: Client, run: Run, ids: list[str], url: str, stop: float) -> None:
    health = Client(url)
    try:
        while time.monotonic() < stop:
            sandbox_id = random.choice(ids)
            t0 = time.perf_counter()
            try:
                up = await health.request("GET", "/healthz")
                state = await client.request("GET", f"/sandboxes/{sandbox_id}")
                ok = up.status_code == 200 and state.status_code == 200
                ok = ok and state.json().get("state") == "ready"
                why = f"healthz {up.status_code}, sandbox {state.status_code} {state.text[:80]}"
            except (TransportError, ValueError) as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            run.health_checks += 1
            if ok:
                run.kinds["health check"].latencies.append(time.perf_counter() - t0)
                run.kinds["health check"].ok += 1
            else:
                run.health_failed.append(why[:200])
                run.invalid.add(sandbox_id)
            await asyncio.sleep(0.5)  # the check's period, not synchronisation
    finally:
        await health.aclose()


async def mixed(args: argparse.Namespace, url: str, secret: str, ids: list[str]) -> Run:
    import httpx

    auth = {"Authorization": f"Bearer {secret}"}
    client = Client(url + "/api/v1", headers=auth)
    http = httpx.AsyncClient(
        base_url=url + "/api/v1", headers=auth, timeout=httpx.Timeout(600.0), trust_env=False
    )
    run = Run()
    stop = time.monotonic() + args.seconds
    ws_base = url.replace("http://", "ws://")
    # --long-seconds 0: no long commands (to attribute what each kind adds)
    tasks = [
        long_loop(client, run, sid, args.long_seconds, stop) for sid in ids if args.long_seconds
    ]
    tasks += [short_loop(client, run, ids, stop) for _ in range(args.short_clients)]
    child = None
    if args.transfer_clients_process and args.transfer_clients:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        child = context.Process(
            target=_transfers_main,
            args=(url, secret, ids, args.bytes, time.time() + args.seconds, args.transfer_clients),
            kwargs={"out": results},
        )
        child.start()
    else:
        tasks += [
            transfer_loop(http, run, ids, args.bytes, stop, i) for i in range(args.transfer_clients)
        ]
    tasks += [
        stream_loop(client, run, ids, ws_base, auth, stop) for _ in range(args.stream_clients)
    ]
    tasks.append(health_loop(client, run, ids, url, stop))
    try:
        await asyncio.gather(*tasks)
        if child is not None:
            kinds, invalid = await asyncio.to_thread(results.get, True, 900)
            _merge(run, kinds, invalid)
    finally:
        await client.aclose()
        await http.aclose()
        if child is not None:
            await asyncio.to_thread(child.join, 60)
    return run


async def delete_all(url: str, secret: str, ids: list[str]) -> int:
    client = Client(url + "/api/v1", headers={"Authorization": f"Bearer {secret}"})
    try:
        answers = await asyncio.gather(
            *(client.request("DELETE", f"/sandboxes/{sid}") for sid in ids)
        )
    finally:
        await client.aclose()
    return sum(1 for a in answers if a.status_code == 202)


def kind_line(name: str, kind: Kind, wall: float) -> str:
    ms = [s * 1e3 for s in kind.latencies]
    refused = ", ".join(f"{k} {v}" for k, v in kind.refused.most_common()) or "none"
    rate = f"{kind.ok / wall:7.1f}/s"
    if kind.nbytes:
        rate += f" {kind.nbytes / wall / 2**20:7.1f} MiB/s"
    if not ms:
        return f"{name:<14} {kind.ok:6d} ok {rate}  (no samples)  refused: {refused}"
    return (
        f"{name:<14} {kind.ok:6d} ok {rate}  p50 {pct(ms, 0.5):8.1f} ms  p99 "
        f"{pct(ms, 0.99):8.1f} ms  mean {statistics.fmean(ms):8.1f} ms  failed "
        f"{len(kind.failed)}  refused (429 by limit): {refused}"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--bytes", type=parse_bytes, default=parse_bytes("200MB"))
    parser.add_argument("--seconds", type=int, default=60, help="length of the mixed phase")
    parser.add_argument("--long-seconds", type=int, default=30, help="0: no long commands")
    parser.add_argument("--short-clients", type=int, default=8)
    parser.add_argument("--transfer-clients", type=int, default=4)
    parser.add_argument("--stream-clients", type=int, default=4)
    parser.add_argument("--idle-samples", type=int, default=300, help="one at a time")
    parser.add_argument(
        "--idle-seconds", type=float, default=20, help="--short-clients with nothing else"
    )
    parser.add_argument("--create-concurrency", type=int, default=50)
    parser.add_argument(
        "--instance-cpu-shares",
        type=int,
        default=0,
        help="once the sandboxes exist, give their instance's parent cpu cgroup this "
        "cpu.shares (default 0: left as the backend made it, the kernel's 1024)",
    )
    parser.add_argument(
        "--transfer-clients-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the transfer clients in a process of their own (default; --no-…: in "
        "this one, as before 2026-12-06 03:40, their bytes then delay the short execs' "
        "answers on the client's own event loop)",
    )
    args = parser.parse_args()
    subnet = pick_subnet("", args.sandboxes)

    # What `make up` starts (bench/_stack.py reads scripts/stack-defaults.env); every
    # limit at the installation's default.
    env = {"HEDGEROW_LOCAL_SUBNET": subnet}
    with private_stack("mx", env) as (stack, secret):
        from django.conf import settings
        from django.db.models import Count
        from django.utils import timezone

        from apps.sandboxes.models import Sandbox, State

        limits = {
            name: getattr(settings, name)
            for name in dir(settings)
            if re.match(r"HEDGEROW_(EXEC|LONG_EXEC|FILE|PTY)_.*(MAX|PER|AFTER)", name)
        }
        print(
            f"mixed: sandboxes={args.sandboxes} bytes={args.bytes} seconds={args.seconds} "
            f"long={args.long_seconds}s short-clients={args.short_clients} "
            f"transfer-clients={args.transfer_clients}"
            f"{' (own process)' if args.transfer_clients_process else ''} "
            f"stream-clients={args.stream_clients} "
            f"cpus={os.cpu_count()} load-before={Path('/proc/loadavg').read_text().split()[0]} "
            f"files-fast-path={settings.HEDGEROW_FILES_FAST_PATH}"
        )
        # (private_stack printed the measured configuration; the subnet is sized for
        # --sandboxes, smaller than make up's /21, which changes nothing measured here)
        print(f"backend {settings.HEDGEROW_BACKEND}")
        print("limits: " + " ".join(f"{k}={v}" for k, v in sorted(limits.items())))
        assert stack.web.popen is not None and stack.worker.popen is not None
        roots = [stack.web.popen.pid, stack.worker.popen.pid]
        since = timezone.now()
        auth = {"Authorization": f"Bearer {secret}"}
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            client = Client(stack.url + "/api/v1", headers=auth)
            t0 = time.perf_counter()
            ids = runner.run(create_all(client, args.sandboxes, args.create_concurrency))
            print(f"created     {len(ids)} sandboxes ready in {time.perf_counter() - t0:.1f} s")
            if args.instance_cpu_shares:
                written = weigh_instance(args.instance_cpu_shares)
                print(f"instance cpu weight {args.instance_cpu_shares} (shares) -> {written}")
            one, idle = runner.run(
                idle_baseline(client, ids, args.idle_samples, args.short_clients, args.idle_seconds)
            )
            runner.run(client.aclose())
            one_ms = [s * 1e3 for s in one.kinds["short exec"].latencies]
            idle_ms = [s * 1e3 for s in idle.kinds["short exec"].latencies]
            print(
                f"idle, one client:   short exec p50 {pct(one_ms, 0.5):.1f} ms  "
                f"p99 {pct(one_ms, 0.99):.1f} ms  ({len(one_ms)} samples)"
            )
            print(
                f"idle, {args.short_clients} clients:   short exec p50 {pct(idle_ms, 0.5):.1f} ms  "
                f"p99 {pct(idle_ms, 0.99):.1f} ms  ({len(idle_ms)} in {args.idle_seconds} s)"
            )
            rss_before = sum(_tree_rss_kib(p) for p in roots)
            sampler = MemorySampler(roots)
            sampler.start()
            cpu0, busy0 = sum(tree_cpu_s(p) for p in roots), machine_busy_s()
            started = time.perf_counter()
            run = runner.run(mixed(args, stack.url, secret, ids))
            wall = time.perf_counter() - started
            cpu1, busy1 = sum(tree_cpu_s(p) for p in roots), machine_busy_s()
            sampler.running = False
            ended = dict(
                Sandbox.objects.filter(external_id__in=ids)
                .values_list("state")
                .annotate(n=Count("id"))
            )
            deleted = runner.run(delete_all(stack.url, secret, ids))
        settle()
        reconcile, audit = reconcile_and_audit(since)

        total_ok = sum(k.ok for k in run.kinds.values())
        lost = ended.get(State.LOST, 0) + ended.get(State.FAILED, 0)
        valid = len(set(ids) - run.invalid) if lost == 0 else len(set(ids) - run.invalid) - lost
        mixed_ms = [s * 1e3 for s in run.kinds["short exec"].latencies]
        ratio = pct(mixed_ms, 0.99) / pct(idle_ms, 0.99) if idle_ms and mixed_ms else float("nan")
        out = [
            f"mixed phase {wall:.1f} s, {total_ok} operations answered correctly: "
            f"{total_ok / wall:.1f} QPS",
            *(kind_line(name, kind, wall) for name, kind in sorted(run.kinds.items())),
            f"short exec p99 under the mix / idle with the same {args.short_clients} clients: "
            f"{ratio:.2f} (goal ≤ 3); / idle one at a time: "
            f"{pct(mixed_ms, 0.99) / pct(one_ms, 0.99):.2f}",
            f"health checks {run.health_checks}, failed {len(run.health_failed)}"
            + (f": {run.health_failed[:3]}" if run.health_failed else ""),
            f"sandbox states after the mix: {ended}",
            f"validity η = {valid}/{len(ids)} = {valid / max(len(ids), 1):.3f} (sandboxes "
            "whose every operation answered correctly and that stayed ready)",
            f"cost per valid lifecycle: {1e3 * (cpu1 - cpu0) / max(valid, 1):.0f} ms CPU of "
            f"this stack's web+worker trees, {1e3 * (busy1 - busy0) / max(valid, 1):.0f} ms "
            "of the whole (shared) machine",
            f"RSS web+worker trees {rss_before / 1024:.0f} MiB before the mix, peak "
            f"{sampler.peak_kib / 1024:.0f} MiB during it "
            f"(+{(sampler.peak_kib - rss_before) / 1024:.0f} MiB; one transfer is "
            f"{args.bytes / 2**20:.0f} MiB, {args.transfer_clients} in flight at once)",
            f"deleted {deleted}/{len(ids)}; reconcile actions={reconcile.actions}",
            f"audit {audit.report.get('equation')} balanced={audit.balanced}",
        ]
        for name, kind in sorted(run.kinds.items()):
            if kind.failed:
                out.append(f"first failures ({name}): {kind.failed[:3]}")
        print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
