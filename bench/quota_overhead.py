"""What the exec hot path pays for quotas, measured in one run on this machine.

    .venv/bin/python -m bench.quota_overhead [--n 3000]

Times, against the real Redis: (a) a bare PING round trip, (b) ``exec_admit`` — the
one Lua call that checks tenant and key exec concurrency and takes a token-bucket
token — and (c) admit + release (what one exec pays in total). No database: the
tenant's limits are put in the per-process cache, as they are after the first exec.
Prints p50/p95/p99 in microseconds and the ratios b/a and c/a.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=3000)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("HEDGEROW_INSTANCE", f"bench{os.getpid()}")
    import django

    django.setup()
    from apps.billing import limits
    from apps.core.redis_sync import redis_client

    tenant_id = str(uuid.uuid4())
    limits._cache[tenant_id] = (
        time.monotonic() + 3600,
        limits.HotLimits(
            max_execs=10_000,
            exec_rate=1e6,
            exec_burst=1_000_000,
            max_upload_bytes=None,
            upload_bytes_per_day=0,
            max_pty=0,
            key_max_execs={"key": 10_000},
        ),
    )
    client = redis_client()
    leases: list[str] = []

    def admit() -> None:
        leases.append(limits.exec_admit(tenant_id=tenant_id, api_key_id="key", timeout_s=60))

    def admit_release() -> None:
        lease = limits.exec_admit(tenant_id=tenant_id, api_key_id="key", timeout_s=60)
        limits.exec_release(tenant_id=tenant_id, api_key_id="key", lease=lease)

    timed(client.ping, 200)  # warm the connection and the script cache
    results = {
        "a ping": timed(client.ping, args.n),
        "b exec_admit": timed(admit, min(args.n, 9000)),
    }
    for lease in leases:
        limits.exec_release(tenant_id=tenant_id, api_key_id="key", lease=lease)
    results["c admit+release"] = timed(admit_release, args.n)
    for key in client.scan_iter(f"{limits._key('*', tenant_id)}*"):
        client.delete(key)
    client.delete(limits._key("bucket", "exec", tenant_id))
    print(f"n={args.n}  (microseconds)")
    for name, samples in results.items():
        print(
            f"{name:18s} p50 {pct(samples, 0.5):7.1f}  p95 {pct(samples, 0.95):7.1f}  "
            f"p99 {pct(samples, 0.99):7.1f}  mean {statistics.fmean(samples):7.1f}"
        )
    base = pct(results["a ping"], 0.5)
    print(
        f"ratios (p50): admit/ping {pct(results['b exec_admit'], 0.5) / base:.2f}  "
        f"admit+release/ping {pct(results['c admit+release'], 0.5) / base:.2f}"
    )


if __name__ == "__main__":
    main()
