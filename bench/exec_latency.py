"""Exec latency and throughput, every path measured in one run on this machine.

    .venv/bin/python -m bench.exec_latency [--n 300] [--web-workers 2] [--seconds 5]

Boots its own stack (fresh database, Celery worker, uvicorn) under a private
HEDGEROW_INSTANCE, creates one `host` sandbox, then measures `bash -c 'echo hi'`:
(a) a bare local subprocess, (b) a direct HTTP call to the sandbox's pod agent,
(c) exec through the REST API (auth + operation record), (d) streamed exec received
over the websocket (time to first byte and to exit), (e) `Sandbox.exec` through the
Python SDK, sync and async (what a user's program sees: the goal is e ≤ 2 × a) with
the client CPU each client spends per exec; then REST throughput with 1, 4 and 16
concurrent clients, with the CPU the web workers and this run's Postgres backends
spent per REST exec (utime+stime from /proc: unlike latency, it does not move with
the load other processes put on the shared cores). Prints p50/p95/p99 and the ratios
c/b, d/b, b/a, e/a, e/c; also (a') a bare subprocess that captures stdout and stderr
through pipes as the agent must (b/a'), and the agent's CPU per exec.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._stack import make_up_settings, private_stack, set_arg

COMMAND = "echo hi"


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50": pct(samples, 0.50) * 1e3,
        "p95": pct(samples, 0.95) * 1e3,
        "p99": pct(samples, 0.99) * 1e3,
        "mean": statistics.fmean(samples) * 1e3,
    }


class Http:
    """A keep-alive HTTP/1.1 connection: the lightest client, so the load generator
    takes as little of the 2 cores as possible."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=60)
        self.headers = {"Content-Type": "application/json", **headers}

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.conn.request("POST", path, body=json.dumps(body), headers=self.headers)
        response = self.conn.getresponse()
        data = json.loads(response.read())
        return response.status, data


def ready_host_sandbox(api: Http, auth: dict[str, str]) -> tuple[str, Any]:
    """Creates a `host` sandbox through the API, waits until it is ready; its id and
    its row (endpoint, generation)."""
    from apps.sandboxes.models import Sandbox

    status, created = api.post("/api/v1/sandboxes", {"image": "host"})
    assert status == 201, created
    sandbox_id = created["id"]
    api.conn.request("GET", f"/api/v1/sandboxes/{sandbox_id}/wait?timeout=60", headers=auth)
    assert api.conn.getresponse().read()
    return sandbox_id, Sandbox.objects.get(external_id=sandbox_id)


class LeanHttp:
    """The client of the direct path (b) and of the REST path (c), so the two are
    compared like with like: what the control plane's own agent client
    (`apps/sandboxes/agent_async.py`) does per exec — the request head and the JSON body
    in one write, the response head split on CRLF, a Content-Length body — on a plain
    keep-alive socket. http.client, used before, sent the head and the body in two
    writes (two TCP segments with TCP_NODELAY, so the agent often woke twice) and parsed
    the response headers with email.parser, costs no real client of the agent pays."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.sock = socket.create_connection((host, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fixed = {"Host": f"{host}:{port}", "Content-Type": "application/json", **headers}
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self.buf = b""

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\n{self.fixed}Content-Length: {len(payload)}\r\n\r\n"
        self.sock.sendall(head.encode("latin-1") + payload)
        buf = self.buf
        while b"\r\n\r\n" not in buf:
            buf += self._recv()
        raw_head, _, buf = buf.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers:
            raise RuntimeError(f"the benchmark expects a Content-Length response: {headers}")
        length = int(headers["content-length"])
        while len(buf) < length:
            buf += self._recv()
        self.buf = buf[length:]
        if headers.get("connection", "").lower() == "close":
            raise RuntimeError("the agent closed the keep-alive connection")
        return status, json.loads(buf[:length])

    def _recv(self) -> bytes:
        data = self.sock.recv(262144)
        if not data:
            raise ConnectionError("the agent closed the connection")
        return data

    def close(self) -> None:
        self.sock.close()


def timed(n: int, fn: Callable[[], None], warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def cpu_of(fn: Callable[[], None], n: int) -> float:
    """This process's CPU (user + system, ms) per call over n sequential calls: the
    client's own cost, which the load on the shared cores hardly moves."""
    before = os.times()
    for _ in range(n):
        fn()
    after = os.times()
    return (after.user - before.user + after.system - before.system) * 1e3 / n


def timed_interleaved(
    n: int, paths: dict[str, Callable[[], None]], warmup: int = 20
) -> dict[str, list[float]]:
    """One sample of each path in turn, n rounds: the load the other engineers' suites
    put on the shared cores drifts by the second, and interleaving gives every path
    the same share of it, so the ratios compare like with like."""
    for _ in range(warmup):
        for fn in paths.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(n):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def throughput(make_call: Callable[[], Callable[[], None]], clients: int, seconds: float) -> float:
    done = [0] * clients
    errors: list[BaseException] = []
    stop = time.monotonic() + seconds
    barrier = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        call = make_call()
        call()  # connect before the clock starts
        barrier.wait()
        try:
            while time.monotonic() < stop:
                call()
                done[i] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.monotonic()
    stop = start + seconds
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done) / (time.monotonic() - start)


def _agent_host_pid(sandbox: Any) -> int | None:
    """The sandbox's agent as the host sees it: the podagent process in its netns."""
    from apps.sandboxes.backends import get_backend

    network = getattr(get_backend(), "network", None)
    if network is None:
        return None
    for pid in network.netns_pids(sandbox.id.hex):
        with contextlib.suppress(OSError):
            proc = Path(f"/proc/{pid}")
            # bwrap (and its pid-namespace init) carry the agent's argv too
            if (proc / "comm").read_text().strip() != "bwrap" and b"podagent" in (
                proc / "cmdline"
            ).read_bytes():
                return int(pid)
    return None


def agent_cpu_per_exec(
    sandbox: Any, call: Callable[[], None], n: int
) -> tuple[int, float, float] | None:
    """(n, agent ms, reaped commands ms) per exec over n sequential direct execs: the
    agent's threads from schedstat (exact), its reaped children from cutime+cstime.
    CPU time, unlike latency, hardly depends on what else the machine runs."""
    pid = _agent_host_pid(sandbox)
    if pid is None:
        return None

    def sample() -> tuple[int, int]:
        own = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                own += int((task / "schedstat").read_text().split()[0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return own, int(fields[13]) + int(fields[14])

    own0, children0 = sample()
    for _ in range(n):
        call()
    own1, children1 = sample()
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    return n, (own1 - own0) / 1e6 / n, (children1 - children0) * tick_ms / n


_TICK = os.sysconf("SC_CLK_TCK")


def _ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return 0
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def _web_pids(root: int) -> list[int]:
    """The uvicorn process and its workers."""
    pids = [root]
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            if int(raw[raw.rindex(")") + 2 :].split()[1]) == root:
                pids.append(int(name))
    return pids


def _postgres_pids() -> list[int]:
    """This run's database backends (the stack's own database: nobody else's load)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return [int(row[0]) for row in cursor.fetchall()]


def cpu_per_exec(
    make_call: Callable[[], Callable[[], None]], clients: int, seconds: float, web_pid: int
) -> tuple[float, float, float]:
    """(exec/s, web CPU ms per exec, Postgres CPU ms per exec): CPU time does not depend
    on what else the shared cores run, as latency does."""
    web, postgres = _web_pids(web_pid), _postgres_pids()
    web0, pg0 = sum(map(_ticks, web)), {pid: _ticks(pid) for pid in postgres}
    rate = throughput(make_call, clients, seconds)
    done = rate * seconds
    web_ms = (sum(map(_ticks, web)) - web0) / _TICK * 1e3 / done
    # A backend the pool opened during the run counts from zero.
    pg_ms = sum(_ticks(pid) - pg0.get(pid, 0) for pid in _postgres_pids()) / _TICK * 1e3 / done
    return rate, web_ms, pg_ms


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300, help="sequential samples per path")
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput level")
    parser.add_argument(
        "--web-workers", type=int, default=int(make_up_settings()["HEDGEROW_WEB_WORKERS"])
    )
    parser.add_argument(
        "--no-fast-path",
        action="store_true",
        help="every REST exec through the DRF view (HEDGEROW_EXEC_FAST_PATH=0), to compare",
    )
    parser.add_argument(
        "--sdk-httpx",
        action="store_true",
        help="also (e0) the sync SDK with every call through httpx, as before its lean "
        "keep-alive path (hedgerow/_lean.py), to compare in the same run",
    )
    args = parser.parse_args()

    def configure(stack: Any) -> None:
        set_arg(stack.web.args, "--workers", str(args.web_workers))  # else as make up
        if args.no_fast_path:
            stack.web.env["HEDGEROW_EXEC_FAST_PATH"] = "0"

    with private_stack("bench", {}, configure) as (stack, secret):
        run(args, stack, secret)
    return 0


def run(args: argparse.Namespace, stack: Any, secret: str) -> None:
    from websockets.sync.client import connect

    from apps.sandboxes.services.operations import agent_for

    auth = {"Authorization": f"Bearer {secret}"}
    api = Http("127.0.0.1", stack.port, auth)
    sandbox_id, row = ready_host_sandbox(api, auth)
    agent = agent_for(row)
    agent_headers = dict(agent.headers)

    def bare() -> None:
        subprocess.run(["bash", "-c", COMMAND], stdout=subprocess.DEVNULL, check=True)

    def bare_piped() -> None:
        # what the agent must do: capture stdout and stderr through pipes
        subprocess.run(["bash", "-c", COMMAND], capture_output=True, check=True)

    def direct_call() -> Callable[[], None]:
        conn = LeanHttp(row.endpoint_host, int(row.endpoint_port or 0), agent_headers)

        def call() -> None:
            status, body = conn.post(
                "/exec", {"operation_id": uuid.uuid4().hex, "command": COMMAND, "timeout": 30}
            )
            assert status == 200 and body["termination"]["exit_code"] == 0, body

        return call

    def rest_call() -> Callable[[], None]:
        conn = LeanHttp("127.0.0.1", stack.port, auth)
        path = f"/api/v1/sandboxes/{sandbox_id}/exec"

        def call() -> None:
            status, body = conn.post(path, {"command": COMMAND, "timeout": 30})
            assert status == 200 and body["exit_code"] == 0, body

        return call

    ws_base = f"ws://127.0.0.1:{stack.port}"
    first_byte: list[float] = []

    stream_api: list[Http] = []

    def streamed() -> None:
        start = time.perf_counter()
        status, body = stream_api[0].post(
            f"/api/v1/sandboxes/{sandbox_id}/exec", {"command": COMMAND, "stream": True}
        )
        assert status == 202, body
        with connect(ws_base + body["stream_url"], additional_headers=auth) as ws:
            got_first = False
            for message in ws:
                frame = json.loads(message)
                if frame["type"] == "exec.stdout" and not got_first:
                    first_byte.append(time.perf_counter() - start)
                    got_first = True
                if frame["type"] == "exec.exit":
                    assert frame["result"]["exit_code"] == 0
                    break

    import asyncio

    from hedgerow import AsyncClient, Client

    url = f"http://127.0.0.1:{stack.port}"
    sdk = Client(url, secret, cleanup=False, handle_signals=False)
    sdk_sandbox = sdk.get(sandbox_id)
    # the async client on one loop kept for the whole run, as a program's would be
    loop = asyncio.new_event_loop()
    asdk = AsyncClient(url, secret, cleanup=False, handle_signals=False)
    asdk_sandbox = loop.run_until_complete(asdk.get(sandbox_id))

    def sdk_call() -> None:
        assert sdk_sandbox.exec(COMMAND).exit_code == 0

    def asdk_call() -> None:
        assert loop.run_until_complete(asdk_sandbox.exec(COMMAND)).exit_code == 0

    paths = {
        "a bare subprocess": bare,
        "a' bare, stdout+stderr piped": bare_piped,
        "b direct agent": direct_call(),
        "c REST exec": rest_call(),
        "e SDK Sandbox.exec": sdk_call,
        "e' SDK async exec": asdk_call,
    }
    if args.sdk_httpx:
        sdk_httpx = Client(url, secret, cleanup=False, handle_signals=False)
        sdk_httpx._lean_for = None  # every call through httpx
        httpx_sandbox = sdk_httpx.get(sandbox_id)

        def sdk_httpx_call() -> None:
            assert httpx_sandbox.exec(COMMAND).exit_code == 0

        paths["e0 SDK through httpx"] = sdk_httpx_call
    results = {name: summary(s) for name, s in timed_interleaved(args.n, paths).items()}
    client_cpu = {
        name: cpu_of(paths[key], args.n)
        for name, key in (
            ("c lean REST client", "c REST exec"),
            ("e SDK sync", "e SDK Sandbox.exec"),
            ("e' SDK async", "e' SDK async exec"),
            ("e0 SDK through httpx", "e0 SDK through httpx"),
        )
        if key in paths
    }
    sdk.close()
    loop.run_until_complete(asdk.aclose())
    loop.close()
    agent_cpu = agent_cpu_per_exec(row, direct_call(), max(args.n * 3, 500))
    stream_n = max(50, args.n // 3)
    stream_api.append(Http("127.0.0.1", stack.port, auth))
    exit_samples = timed(stream_n, streamed, warmup=10)
    first_byte[:] = first_byte[-stream_n:]
    results["d stream: first byte"] = summary(first_byte)
    results["d stream: exit"] = summary(exit_samples)

    print(f"\nexec `bash -c '{COMMAND}'`, n={args.n} (stream n={stream_n}), "
          f"web workers={args.web_workers}, cpus={os.cpu_count()}, "
          f"fast path={'off' if args.no_fast_path else 'on'}, "
          f"a/b/c interleaved, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| path | p50 ms | p95 ms | p99 ms | mean ms |\n|---|---:|---:|---:|---:|")
    for name, s in results.items():
        print(f"| {name} | {s['p50']:.2f} | {s['p95']:.2f} | {s['p99']:.2f} | {s['mean']:.2f} |")
    a, b = results["a bare subprocess"]["p50"], results["b direct agent"]["p50"]
    c, d = results["c REST exec"]["p50"], results["d stream: exit"]["p50"]
    a2 = results["a' bare, stdout+stderr piped"]["p50"]
    e, e2 = results["e SDK Sandbox.exec"]["p50"], results["e' SDK async exec"]["p50"]
    print(f"\nratios of p50: c/b = {c / b:.2f} (target ≤ 2), d/b = {d / b:.2f}, "
          f"b/a = {b / a:.2f} (target ≤ 1.3), b/a' = {b / a2:.2f}")  # fmt: skip
    print(f"SDK: e/a = {e / a:.2f} (target ≤ 2), e'/a = {e2 / a:.2f}, "
          f"e/c = {e / c:.2f}, e'/c = {e2 / c:.2f} (the SDK over the lean client)")  # fmt: skip
    print("client CPU per exec (user+sys ms, sequential): " + ", ".join(
        f"{name} {ms:.3f}" for name, ms in client_cpu.items()))  # fmt: skip
    if agent_cpu is not None:
        n_cpu, own, reaped = agent_cpu
        print(f"agent CPU per direct exec ({n_cpu} sequential): agent {own:.3f} ms, "
              f"the commands it reaped {reaped:.3f} ms")  # fmt: skip
    print("\nthroughput (exec/s, completed commands) and CPU per REST exec (ms):")
    print("| clients | REST | direct agent | web CPU | Postgres CPU |\n|---:|---:|---:|---:|---:|")
    assert stack.web.popen is not None
    for clients in (1, 4, 16):
        rest, web_ms, pg_ms = cpu_per_exec(rest_call, clients, args.seconds, stack.web.popen.pid)
        direct = throughput(direct_call, clients, args.seconds)
        print(f"| {clients} | {rest:.0f} | {direct:.0f} | {web_ms:.2f} | {pg_ms:.2f} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
