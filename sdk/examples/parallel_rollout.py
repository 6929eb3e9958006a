"""A parallel rollout: N sandboxes at once with asyncio, one task each.

    python sdk/examples/parallel_rollout.py --n 100 --concurrency 32

Every sandbox is deleted at the end of its block; if the run is interrupted
(Ctrl-C, SIGTERM), the client's cleanup deletes whatever is still alive.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import hedgerow


async def rollout(client: hedgerow.AsyncClient, task: int, gate: asyncio.Semaphore) -> bool:
    async with gate:
        async with await client.create_sandbox(labels={"example": "parallel"}) as sb:
            await sb.write_file("/workspace/task.txt", f"{task}\n")
            result = await sb.exec("test $(cat /workspace/task.txt) -ge 0 && echo solved")
            return result.ok and result.stdout.strip() == "solved"


async def main(n: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    async with hedgerow.AsyncClient() as client:
        results = await asyncio.gather(
            *(rollout(client, i, gate) for i in range(n)), return_exceptions=True
        )
    solved = sum(1 for r in results if r is True)
    failed = [r for r in results if isinstance(r, BaseException)]
    print(f"{solved}/{n} solved, {len(failed)} errors in {time.perf_counter() - start:.1f}s")
    for error in failed[:5]:
        print("  ", type(error).__name__, error)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.concurrency))
