"""CPU of one web request, in process, without the noise of the other processes: the
ASGI application (``controlplane.asgi.application``, the object uvicorn serves) is
called directly, sequentially, and this process's CPU time is read around each
batch. Postgres and Redis are the real ones (a private database and instance);
no Celery worker runs, so created sandboxes stay ``requested`` (their enqueued
provision tasks are dropped with the instance's Redis keys at the end).

    .venv/bin/python -m bench.web_request_cost [N] [--profile STEP] [--sort cumulative]

Steps: ``healthz`` (Django's middleware alone), ``get`` (GET /sandboxes/<id>),
``create`` (POST /sandboxes with an Idempotency-Key), ``readysim`` (what the worker
does for a waiter — publish ``provisioning``, commit ``ready``, publish — with no
request: the baseline of the next step), ``waitblock`` (GET /sandboxes/<id>/wait on a
requested sandbox that becomes ready while it waits: subtract ``readysim``), ``wait``
(GET /sandboxes/<id>/wait on a ready sandbox), ``delete`` (DELETE /sandboxes/<id> on a
ready one), ``exec404`` (POST exec on a missing sandbox: the fast path's hand-off to
DRF). ``--profile STEP`` prints a cProfile of that step's N requests.

``--concurrency C`` keeps C requests of each step in flight at once (as under load;
the DB pool is then min(C, ``--db-pool``)), ``--uvloop`` runs the loop uvicorn runs on,
``--steps a,b`` runs a subset. Besides CPU, each step reports the context switches of
this process's threads and the cyclic collector's CPU time and runs per request.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _setup() -> tuple[str, str]:
    pid = os.getpid()
    db_name = f"hr_bench_wrc_{pid}"
    os.environ.update(
        HEDGEROW_INSTANCE=f"wrc{pid}",
        HEDGEROW_DB_NAME=db_name,
        HEDGEROW_DB_POOL="1",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        HEDGEROW_LOG_LEVEL="WARNING",
        HEDGEROW_MAX_LIVE_SANDBOXES="0",
    )
    os.environ.setdefault("HEDGEROW_SECRET_KEY", uuid.uuid4().hex + uuid.uuid4().hex)
    sys.path.insert(0, str(ROOT))
    import psycopg

    from apps.core.env import db_conninfo

    with psycopg.connect(db_conninfo("postgres"), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    import subprocess

    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True)
    return db_name, f"wrc{pid}"


def _teardown(db_name: str) -> None:
    import psycopg
    from django.conf import settings
    from django.db import connections

    from apps.core.env import db_conninfo
    from apps.core.redis_sync import redis_client

    connections.close_all()
    client = redis_client()
    keys = list(client.scan_iter(match=f"{settings.REDIS_KEY_PREFIX}*", count=1000))
    if keys:
        client.delete(*keys)
    with psycopg.connect(db_conninfo("postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


async def _call(
    app: Any, method: str, path: str, secret: str, body: bytes = b"", **headers: str
) -> tuple[int, bytes]:
    query = b""
    if "?" in path:
        path, q = path.split("?", 1)
        query = q.encode()
    raw = [
        (b"host", b"127.0.0.1:8000"),
        (b"authorization", f"Bearer {secret}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ] + [(k.lower().replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    status = 0
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=300)
    parser.add_argument("--profile", default="")
    parser.add_argument("--sort", default="cumulative")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--spy", default="", help="STEP:FILE: py-spy (raw, all threads) of a step")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests of a step in flight at once"
    )
    parser.add_argument("--db-pool", type=int, default=60, help="with --concurrency > 1")
    parser.add_argument("--uvloop", action="store_true", help="the loop uvicorn runs on")
    parser.add_argument("--steps", default="", help="comma-separated subset (create is kept)")
    args = parser.parse_args()
    if args.concurrency > 1:
        os.environ["HEDGEROW_DB_POOL_MAX"] = str(min(args.concurrency, args.db_pool))
    db_name, _instance = _setup()
    try:
        if args.uvloop:
            import uvloop

            uvloop.install()
        return asyncio.run(_run(args))
    finally:
        _teardown(db_name)


async def _run(args: Any) -> int:
    import django

    django.setup()
    from asgiref.sync import sync_to_async

    from apps.sandboxes.models import Sandbox, State
    from apps.tenancy.services import api_key_create, tenant_create
    from controlplane.asgi import application

    tenant = await sync_to_async(tenant_create)(slug="bench")
    secret = (
        await sync_to_async(api_key_create)(tenant=tenant, name="b", scopes=["read", "write"])
    ).secret
    n = args.n
    ids: list[str] = []

    async def create(i: int) -> None:
        status, body = await _call(
            application,
            "POST",
            "/api/v1/sandboxes",
            secret,
            json.dumps({"image": "host"}).encode(),
            idempotency_key=uuid.uuid4().hex,
        )
        assert status == 201, body
        ids.append(json.loads(body)["id"])

    def make_ready() -> None:
        Sandbox.objects.filter(external_id__in=ids).update(state=State.READY)

    async def get(i: int) -> None:
        status, body = await _call(application, "GET", f"/api/v1/sandboxes/{ids[i]}", secret)
        assert status == 200, body

    async def wait(i: int) -> None:
        path = f"/api/v1/sandboxes/{ids[i]}/wait?timeout=5"
        status, body = await _call(application, "GET", path, secret)
        assert status == 200, body

    uuids: dict[str, str] = {}

    def make_requested() -> None:
        Sandbox.objects.filter(external_id__in=ids).update(state=State.REQUESTED)
        uuids.update(
            (ext, str(pk))
            for ext, pk in Sandbox.objects.filter(external_id__in=ids).values_list(
                "external_id", "id"
            )
        )

    def become_ready(i: int) -> None:
        # What the worker does for a waiter: publish provisioning, commit ready, publish.
        from apps.core.redis_sync import redis_client
        from apps.sandboxes.events import sandbox_channel

        channel = sandbox_channel(uuids[ids[i]])
        redis_client().publish(channel, json.dumps({"state": State.PROVISIONING}))
        Sandbox.objects.filter(pk=uuids[ids[i]]).update(state=State.READY)
        redis_client().publish(channel, json.dumps({"state": State.READY}))

    async def readysim(i: int) -> None:
        await asyncio.sleep(0.002)
        await sync_to_async(become_ready)(i)

    async def waitblock(i: int) -> None:
        path = f"/api/v1/sandboxes/{ids[i]}/wait?timeout=10"
        answer = asyncio.ensure_future(_call(application, "GET", path, secret))
        await readysim(i)
        status, body = await answer
        assert status == 200, body

    async def delete(i: int) -> None:
        status, body = await _call(application, "DELETE", f"/api/v1/sandboxes/{ids[i]}", secret)
        assert status == 202, body

    async def healthz(i: int) -> None:
        status, body = await _call(application, "GET", "/healthz", secret)
        assert status == 200, body

    async def exec404(i: int) -> None:
        body = json.dumps({"command": "echo hi"}).encode()
        status, out = await _call(
            application, "POST", "/api/v1/sandboxes/sb-nope/exec", secret, body
        )
        assert status == 404, out

    # Warm-up: first requests import and compile lazily.
    for _ in range(5):
        await healthz(0)
    await create(0)
    ids.clear()

    steps: list[tuple[str, Callable[[int], Any]]] = [
        ("healthz", healthz),
        ("create", create),
        ("readysim", readysim),
        ("waitblock", waitblock),
        ("get", get),
        ("wait", wait),
        ("exec404", exec404),
        ("delete", delete),
    ]
    if args.steps:
        wanted = set(args.steps.split(",")) | {"create"}
        steps = [(name, step) for name, step in steps if name in wanted]
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"web_request_cost: N={n} concurrency={args.concurrency} load={load}")
    import gc

    print(f"gc thresholds {gc.get_threshold()}, frozen objects {gc.get_freeze_count()}")
    gc_clock = _GcClock()
    print(
        f"{'step':<9} {'cpu ms/req':>10} {'wall ms/req':>11} {'vcsw/req':>8} {'ivcsw/req':>9}"
        f" {'gc ms/req':>9} gc runs (gen 0/1/2)"
    )
    for name, step in steps:
        if name in ("readysim", "waitblock"):
            await sync_to_async(make_requested)()
        if name == "get":
            await sync_to_async(make_ready)()
        profiler = cProfile.Profile() if args.profile == name else None
        spy = None
        if args.spy and args.spy.split(":", 1)[0] == name:
            import subprocess

            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "-p",
                    str(os.getpid()),
                    "-r",
                    "400",
                    "-f",
                    "raw",
                    "--gil",
                    "-o",
                    args.spy.split(":", 1)[1],
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        s0, g0 = _switches(), gc_clock.snapshot()
        c0, w0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        await _in_flight(step, n, args.concurrency)
        if profiler is not None:
            profiler.disable()
        c1, w1 = time.process_time(), time.perf_counter()
        s1, g1 = _switches(), gc_clock.snapshot()
        if spy is not None:
            import signal

            spy.send_signal(signal.SIGINT)
            spy.wait()
        runs = "/".join(str(b - a) for a, b in zip(g0[1], g1[1], strict=True))
        print(
            f"{name:<9} {1e3 * (c1 - c0) / n:10.2f} {1e3 * (w1 - w0) / n:11.2f}"
            f" {(s1[0] - s0[0]) / n:8.1f} {(s1[1] - s0[1]) / n:9.1f}"
            f" {1e3 * (g1[0] - g0[0]) / n:9.3f} {runs}"
        )
        if profiler is not None:
            stats = pstats.Stats(profiler)
            stats.sort_stats(args.sort).print_stats(args.top)
    return 0


async def _in_flight(step: Callable[[int], Any], n: int, concurrency: int) -> None:
    """Requests 0..n-1 of a step, ``concurrency`` of them in flight at any time."""
    if concurrency <= 1:
        for i in range(n):
            await step(i)
        return
    next_index = 0

    async def lane() -> None:
        nonlocal next_index
        while next_index < n:
            i = next_index
            next_index += 1
            await step(i)

    await asyncio.gather(*(lane() for _ in range(concurrency)))


class _GcClock:
    """CPU time spent in the cyclic collector, and collections per generation."""

    def __init__(self) -> None:
        import gc

        self.seconds = 0.0
        self.runs = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started
            self.runs[info["generation"]] += 1

    def snapshot(self) -> tuple[float, list[int]]:
        return self.seconds, list(self.runs)


def _switches() -> tuple[int, int]:
    """Voluntary and involuntary context switches of all this process's threads."""
    voluntary = involuntary = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    involuntary += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return voluntary, involuntary


if __name__ == "__main__":
    raise SystemExit(main())
