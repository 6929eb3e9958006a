"""The sampler's bulk difficulty read against a real web process: p50/p95/p99 of
``POST /api/v1/tasks/difficulty`` with 10,000 task ids (the body form: 10,000 ids do
not fit a URL uvicorn accepts), of ``GET /api/v1/tasks/difficulty`` (every task, no
ids), and of a 100-id GET, on a private stack whose team has ``--tasks`` tasks × 2
policy families in the maintained aggregate.

    .venv/bin/python -m bench.difficulty_bulk [--tasks 10000] [--n 200]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench._http import Client
from bench._stack import private_stack


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, samples: list[float]) -> str:
    return (
        f"{name:<34} n={len(samples):<4} p50 {pct(samples, 0.5):7.1f} ms  "
        f"p95 {pct(samples, 0.95):7.1f} ms  p99 {pct(samples, 0.99):7.1f} ms"
    )


def seed(tasks: int) -> list[str]:
    from django.utils import timezone

    from apps.datasets.models import TaskDifficulty
    from apps.datasets.services.difficulty import Prior, bulk_row
    from apps.tenancy.models import Tenant

    tenant = Tenant.objects.get(slug="bench")
    ids = [f"swe-task-{i:06d}" for i in range(tasks)]
    now = timezone.now()
    prior = Prior.default()
    rows = []
    for i, t in enumerate(ids):
        for fam in ("model-a", "model-b"):
            s, f = float(i % 7), float(i % 5)
            rows.append(
                TaskDifficulty(
                    tenant=tenant,
                    task_id=t,
                    family=fam,
                    version="v3",
                    s_eff=s,
                    f_eff=f,
                    successes=i % 7,
                    failures=i % 5,
                    updated_at=now,
                    row_json=bulk_row(t, fam, prior, s, f, "v3", False),
                    alpha0=prior.alpha0,
                    beta0=prior.beta0,
                )
            )
    # the rows summary_refresh() maintains as episodes close, written in one go
    TaskDifficulty.objects.bulk_create(rows, batch_size=5000)
    return ids


async def measure(url: str, secret: str, ids: list[str], n: int) -> dict[str, list[float]]:
    client = Client(url, headers={"Authorization": f"Bearer {secret}"})
    out: dict[str, list[float]] = {}
    cases: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]] = [
        (f"POST {len(ids)} ids", "POST", {"ids": ids}, None),
        ("GET every task", "GET", None, None),
        ("GET 100 ids", "GET", None, {"ids": ",".join(ids[:100])}),
    ]
    for name, method, body, params in cases:
        for _ in range(5):  # warm the connection, the key cache, the plan
            await client.request(method, "/api/v1/tasks/difficulty", json=body, params=params)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            response = await client.request(
                method, "/api/v1/tasks/difficulty", json=body, params=params
            )
            samples.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, response.text[:300]
        tasks = len(response.json()["rows"])
        out[f"{name} ({tasks} rows back)"] = samples
    await client.aclose()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()

    # The stack as `make up` runs it (bench/_stack.py).
    with private_stack("difficulty", {}) as (stack, secret):
        ids = seed(args.tasks)
        results = asyncio.run(measure(stack.url, secret, ids, args.n))
    for name, samples in results.items():
        print(line(name, samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
