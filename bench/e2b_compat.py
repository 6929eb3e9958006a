"""The E2B SDK against Hedgerow, measured in one run on this machine.

    .venv/bin/python -m bench.e2b_compat [--n 200] [--concurrent 200] [--web-workers 2]

Boots its own stack (bench/_stack.py), then:
(1) exec round trip of `echo hi`: the e2b SDK's `commands.run` (envd Connect stream
    through /e2b/envd) against Hedgerow's own SDK `exec` (the REST fast path), both on
    one sandbox each, interleaved call by call so load drifts hit both alike; prints
    p50/p95 and the ratio (the goal is within 1.5x);
(2) `--concurrent` E2B rollouts at once through `AsyncSandbox`: create -> run -> kill,
    wall time and per-rollout p50/p95, with failures counted and named.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench._stack import make_up_settings, private_stack, set_arg


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, samples: list[float]) -> str:
    return (
        f"{name:<34} p50 {pct(samples, 0.5) * 1e3:7.2f} ms  p95 {pct(samples, 0.95) * 1e3:7.2f} ms"
        f"  mean {statistics.fmean(samples) * 1e3:7.2f} ms  (n={len(samples)})"
    )


def round_trips(stack: Any, secret: str, n: int) -> None:
    import hedgerow
    from e2b import Sandbox

    opts = {
        "api_key": secret,
        "api_url": stack.url + "/e2b",
        "sandbox_url": stack.url + "/e2b/envd",
        "request_timeout": 60,
    }
    client = hedgerow.Client(stack.url, secret)
    own = client.create_sandbox(image="host")
    e2b = Sandbox.create(**opts)
    try:
        for _ in range(5):  # warm both paths' connections and caches
            own.exec("echo hi")
            e2b.commands.run("echo hi")
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(n):
            start = time.perf_counter()
            assert own.exec("echo hi").stdout == "hi\n"
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert e2b.commands.run("echo hi").stdout == "hi\n"
            theirs.append(time.perf_counter() - start)
        print(line("hedgerow SDK exec (REST)", ours))
        print(line("e2b SDK commands.run (envd)", theirs))
        ratio = statistics.median(theirs) / statistics.median(ours)
        print(f"ratio e2b/hedgerow at p50: {ratio:.2f}x (goal <= 1.5x)")
    finally:
        e2b.kill()
        own.delete()


def concurrent_rollouts(stack: Any, secret: str, count: int) -> None:
    from e2b import AsyncSandbox

    opts = {
        "api_key": secret,
        "api_url": stack.url + "/e2b",
        "sandbox_url": stack.url + "/e2b/envd",
        "request_timeout": 120,
    }
    durations: list[float] = []
    failures: dict[str, int] = {}

    async def rollout(n: int) -> None:
        start = time.perf_counter()
        try:
            sbx = await AsyncSandbox.create(**opts)
            try:
                result = await sbx.commands.run(f"echo {n}")
                assert result.stdout == f"{n}\n", result.stdout
            finally:
                await sbx.kill()
            durations.append(time.perf_counter() - start)
        except Exception as exc:
            key = f"{type(exc).__name__}: {str(exc)[:120]}"
            failures[key] = failures.get(key, 0) + 1

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(rollout(n) for n in range(count)))
        return time.perf_counter() - start

    wall = asyncio.run(main())
    print(f"{count} concurrent create -> run -> kill: wall {wall:.1f} s, ok {len(durations)}")
    if durations:
        print(line("  one rollout", durations))
    for key, times in sorted(failures.items()):
        print(f"  failed x{times}: {key}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="round trips per SDK")
    parser.add_argument("--concurrent", type=int, default=200, help="concurrent rollouts")
    parser.add_argument(
        "--web-workers", type=int, default=int(make_up_settings()["HEDGEROW_WEB_WORKERS"])
    )
    args = parser.parse_args()

    def configure(stack: Any) -> None:
        set_arg(stack.web.args, "--workers", str(args.web_workers))  # else as make up

    with private_stack("e2b", {}, configure) as (stack, secret):
        round_trips(stack, secret, args.n)
        if args.concurrent:
            concurrent_rollouts(stack, secret, args.concurrent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
