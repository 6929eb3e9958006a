"""A fork through the whole control plane: ``POST /snapshots/{id}/fork`` of K children
of a sandbox with ``--mib`` of changed state, until every child is ``ready`` (each
verified: tree, services, probes, ports, processes, environment), on a private stack
(its own database, web, Celery worker with 4 processes, instance).

    sudo .venv/bin/python -m bench.fork_api [--count 64] [--mib 0]

Prints the wall time
from the request to the last child ready, and where each child's time went from the
ledger (queued until its provision was claimed, then provisioning to ready). On a
shared machine compare runs taken together (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx

from bench._stack import private_stack


def _wait(http: httpx.Client, path: str, until: tuple[str, ...], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        body = http.get(path).json()
        if body.get("state") in until:
            return body
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} still {body.get('state')} after {timeout}s")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--mib", type=int, default=0)
    args = p.parse_args()
    with private_stack("fk", {}, lambda stack: None) as (stack, secret):
        http = httpx.Client(
            base_url=stack.url + "/api/v1",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=120,
            trust_env=False,
        )
        made = http.post("/sandboxes", json={"image": "host", "ttl_seconds": 3600})
        parent = made.json()["id"]
        _wait(http, f"/sandboxes/{parent}", ("ready",), 120)
        command = "echo state > /workspace/s"
        if args.mib:
            command += f" && head -c {args.mib << 20} /dev/urandom > /workspace/data.bin"
        ran = http.post(f"/sandboxes/{parent}/exec", json={"command": command, "timeout": 600})
        assert ran.json()["exit_code"] == 0, ran.text
        snap = http.post(
            f"/sandboxes/{parent}/snapshots",
            json={"probes": [{"name": "state", "command": "cat /workspace/s"}]},
        ).json()
        snap = _wait(http, f"/snapshots/{snap['id']}", ("ready", "failed"), 600)
        assert snap["state"] == "ready", snap
        t0 = time.perf_counter()
        forked = http.post(f"/snapshots/{snap['id']}/fork", json={"count": args.count})
        assert forked.status_code == 201, forked.text
        answered = time.perf_counter() - t0
        ids = [c["id"] for c in forked.json()["sandboxes"]]
        states = [_wait(http, f"/sandboxes/{i}", ("ready", "failed"), 600)["state"] for i in ids]
        wall = time.perf_counter() - t0
        from apps.sandboxes.models import SandboxEvent

        waits, provisions = [], []
        for sandbox_id in ids:
            moves = {
                e.to_state: e.at
                for e in SandboxEvent.objects.filter(
                    sandbox__external_id=sandbox_id, event__in=("created", "transition")
                )
            }
            waits.append((moves["provisioning"] - moves["requested"]).total_seconds())
            provisions.append((moves["ready"] - moves["provisioning"]).total_seconds())
        print(
            f"fork {args.count} ({args.mib} MiB): {wall:.2f} s to all "
            f"ready (request answered in {answered:.2f} s); "
            f"{states.count('ready')} ready, {states.count('failed')} failed; "
            f"per child: wait for a provision slot median {statistics.median(waits):.2f} s "
            f"(max {max(waits):.2f}), provisioning→ready (restore + verification) "
            f"median {statistics.median(provisions):.2f} s (max {max(provisions):.2f})"
        )


if __name__ == "__main__":
    main()
