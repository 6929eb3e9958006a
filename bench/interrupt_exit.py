"""Ctrl-C during an async gather of creates: how long the process takes to exit after
the signal and how many sandboxes it leaves live (issue 26 defect 1: "exit promptly";
the issue measured 100 / 94 / 16 / 0 leaked after 0.2 / 0.5 / 1.5 / 3 s, exiting 7.5-9 s
after the signal).

    .venv/bin/python -m bench.interrupt_exit [--count 50] [--after 0.2 0.5 1.5 3] [--sdk DIR]

A private stack (bench/_stack.py). Per delay: a child Python runs
``asyncio.gather`` of --count ``create_sandbox()`` calls through the SDK; the bench
sends SIGINT --after seconds after starting it, times the exit, then counts the bench
tenant's sandboxes not terminating/deleted/failed/lost. Never a gate.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SDK_DIR = Path(__file__).resolve().parents[1] / "sdk"

CHILD = """
import asyncio
import faulthandler
import signal
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the bench asks on a hang
from hedgerow import AsyncClient

async def main():
    async with AsyncClient() as hr:
        await asyncio.gather(*(hr.create_sandbox() for _ in range({count})))

asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--after", type=float, nargs="+", default=[0.2, 0.5, 1.5, 3.0])
    parser.add_argument("--sdk", default=str(SDK_DIR), help="SDK dir (before/after runs)")
    parser.add_argument("--hang", type=float, default=60.0, help="seconds before 'hung'")
    args = parser.parse_args()

    from bench._stack import private_stack

    with private_stack("interrupt", {}, lambda stack: None) as (stack, secret):
        from apps.sandboxes.models import Sandbox, State
        from apps.tenancy.models import Tenant

        gone = (State.TERMINATING, State.DELETED, State.FAILED, State.LOST)
        tenant = Tenant.objects.get(slug="bench")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HEDGEROW_")}
        env.update(HEDGEROW_URL=stack.url, HEDGEROW_API_KEY=secret, PYTHONPATH=args.sdk)
        code = textwrap.dedent(CHILD.format(count=args.count))
        print(f"async gather of {args.count} creates, SIGINT after the delay")
        print(f"{'after s':>8} {'exit s':>7} {'code':>5} {'made':>5} {'leaked':>7}")
        for after in args.after:
            before = set(Sandbox.objects.filter(tenant=tenant).values_list("id", flat=True))
            stacks = Path(tempfile.mkstemp(prefix="hr-interrupt-", suffix=".txt")[1])
            with stacks.open("w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=err
                )
            time.sleep(after)
            proc.send_signal(signal.SIGINT)
            signalled = time.perf_counter()
            try:
                rc = proc.wait(timeout=args.hang)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack
                time.sleep(1)
                proc.kill()
                rc = proc.wait()
                print(f"  hung after SIGINT; thread stacks in {stacks}")
            exit_s = time.perf_counter() - signalled
            made = Sandbox.objects.filter(tenant=tenant).exclude(id__in=before)
            leaked = made.exclude(state__in=gone).count()
            print(f"{after:8.1f} {exit_s:7.2f} {rc:5} {made.count():5} {leaked:7}")


if __name__ == "__main__":
    main()
