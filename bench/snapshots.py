"""What snapshots cost on this machine, measured in one run (docs/snapshots.md).

    sudo .venv/bin/python -m bench.snapshots [--sizes 0,10,100,1024] [--fork 64]

On the local backend directly (no control plane), with ``host`` sandboxes (the state
is /workspace, /tmp and, for images, the upper dir: all one btrfs subvolume). For each
amount of changed bytes (random data written in the sandbox):

* capture: how long the sandbox is frozen (the snapshot ioctl) and the whole
  ``snapshot()`` call (freeze + snapshot + tree hash), against ``tar -cf`` of the same
  dirs onto the same storage (what a content-addressed layer would cost to write);
* restore: provision from the snapshot until the agent answers, against a plain
  provision;
* fork: ``--fork`` children restored concurrently (8 threads), all verified (the
  tree check runs inside provision), wall time for all of them.

Prints ratios, not pass/fail. ``--breakdown`` also times each phase of the fork's
provisions (wall time summed over the children, divided by their number: with 8
threads on 2 cores these overlap, so compare shares, not sums, with the fork's wall).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from apps.sandboxes.backends.base import SandboxSpec
from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, wait_healthy
from apps.sandboxes.backends.local.zygote import ZygoteClient
from bench.cpu_account import _TICK, NOT_OURS, CpuAccount, Scope

REPO = Path(__file__).resolve().parents[1]


def _spec(**overrides: object) -> SandboxSpec:
    spec = SandboxSpec(
        sandbox_id=uuid.uuid4().hex,
        tenant_id="bench",
        generation=1,
        image="host",
        cpu_millis=1000,
        memory_mib=256,
        network_access=False,
        agent_token=uuid.uuid4().hex,
        disk_mib=4096,
    )
    return replace(spec, **overrides)  # type: ignore[arg-type]


def _start(b: LocalBackend, spec: SandboxSpec) -> float:
    t0 = time.perf_counter()
    endpoint = b.provision(spec)
    wait_healthy(endpoint, spec.agent_token, timeout=60)
    return time.perf_counter() - t0


class Phases:
    """Wall time per provisioning phase, summed over calls (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.on:
                    with self.lock:
                        self.total[name] += time.perf_counter() - t0
                        self.calls[name] += 1

        setattr(obj, attr, timed)

    def report(self, children: int) -> str:
        parts = [
            f"{name} {self.total[name] / children * 1000:.1f}"
            for name in sorted(self.total, key=lambda n: -self.total[n])
        ]
        return "per child, ms of wall (overlapping): " + ", ".join(parts)


def _instrument(b: LocalBackend, phases: Phases) -> None:
    assert b.storage is not None
    phases.wrap(b, "provision", "provision (all)")
    phases.wrap(b.storage, "restore", "clone volume")
    phases.wrap(b.network, "create", "netns+veth+nft")
    phases.wrap(b.network, "claim_ip", "claim ip")
    phases.wrap(b.cgroups, "create", "cgroups")
    phases.wrap(b, "_verify_restore", "owner shift+tree check")
    phases.wrap(b, "_spawn_from_zygote", "zygote spawn")
    phases.wrap(b, "_save_meta", "meta writes")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="0,10,100", help="MiB of changed state, comma-separated")
    p.add_argument("--fork", type=int, default=16)
    p.add_argument("--threads", type=int, default=8, help="concurrent provisions in the fork")
    p.add_argument("--breakdown", action="store_true", help="time each provisioning phase")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the fork's exact CPU (this process, the zygote, bwrap, agents: bench/cpu_account)",
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hedgerow-bench-snap-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    b = LocalBackend(
        LocalBackendConfig(
            state_dir=tmp / "state",
            instance=f"bsn{os.getpid()}",
            podagent_dir=REPO / "podagent",
            isolation="netns",
            image_store=tmp / "images",
        )
    )
    made: list[str] = []
    snaps: list[str] = []
    phases = Phases()
    try:
        warm = _spec()
        made.append(warm.sandbox_id)
        _start(b, warm)  # zygote, storage, network: warm
        assert b.storage is not None
        if args.breakdown:
            _instrument(b, phases)
        print(
            f"{'MiB':>6} {'frozen ms':>10} {'snapshot s':>11} {'tar s':>7} "
            f"{'restore s':>10} {'plain s':>8} {f'fork {args.fork} s':>10}"
        )
        for mib in [int(x) for x in args.sizes.split(",")]:
            parent = _spec()
            made.append(parent.sandbox_id)
            _start(b, parent)
            ws = b.storage.mount / parent.sandbox_id / "workspace"
            if mib:
                subprocess.run(
                    ["dd", "if=/dev/urandom", f"of={ws / 'data.bin'}", "bs=1M", f"count={mib}"],
                    check=True,
                    capture_output=True,
                )
            snap_id = uuid.uuid4().hex
            snaps.append(snap_id)
            t0 = time.perf_counter()
            info = b.snapshot(parent.sandbox_id, snap_id)
            snap_s = time.perf_counter() - t0
            tar = b.storage.mount / f".bench-{snap_id}.tar"
            t0 = time.perf_counter()
            subprocess.run(
                [
                    "tar",
                    "-cf",
                    str(tar),
                    "-C",
                    str(b.storage.mount / parent.sandbox_id),
                    "workspace",
                    "tmp",
                ],
                check=True,
            )
            os.sync()
            tar_s = time.perf_counter() - t0
            tar.unlink()
            plain = []
            for _ in range(3):
                s = _spec()
                made.append(s.sandbox_id)
                plain.append(_start(b, s))
            restore = []
            for _ in range(3):
                s = _spec(snapshot_id=snap_id)
                made.append(s.sandbox_id)
                restore.append(_start(b, s))
            children = [_spec(snapshot_id=snap_id) for _ in range(args.fork)]
            made.extend(c.sandbox_id for c in children)
            phases.on = True
            waits: list[float] = []

            def child(c: SandboxSpec, waits: list[float] = waits) -> None:
                endpoint = b.provision(c)
                t0 = time.perf_counter()
                wait_healthy(endpoint, c.agent_token, timeout=60)
                waits.append(time.perf_counter() - t0)

            cpu = None
            if args.cpu:

                def zygote_pid(zygote: ZygoteClient = b.zygote) -> int | None:
                    answer = zygote.ping()
                    return int(answer["pid"]) if answer else None

                cpu = CpuAccount(Scope(zygote=zygote_pid), "off")
                cpu.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(child, children))
            fork_s = time.perf_counter() - t0
            phases.on = False
            if cpu is not None:
                cpu.stop()
                parts = cpu.breakdown()
                ours = {k: v for k, v in parts.items() if k not in NOT_OURS and v > 0}
                total = sum(ours.values())
                cores = os.cpu_count() or 1
                print(
                    f"  {mib} MiB fork {args.fork}: CPU {total:.2f} s "
                    f"= {total / len(children) * 1000:.0f} ms per child ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ours.items()))
                    + f"); machine busy {cpu.busy_ticks / _TICK:.1f} s in {cpu.wall:.2f} s; "
                    f"on {cores} idle cores ≥ {total / cores:.2f} s"
                )
            if args.breakdown:
                phases.total["agent answers"] = sum(waits)
                print(f"  {mib} MiB fork {args.fork}: {phases.report(len(children))}")
                phases.total.clear()
            print(
                f"{mib:>6} {info.capture_s * 1000:>10.1f} {snap_s:>11.3f} {tar_s:>7.3f} "
                f"{statistics.median(restore):>10.3f} {statistics.median(plain):>8.3f} "
                f"{fork_s:>10.2f}"
            )
            for sid in made[1:]:
                b.destroy(sid)
            del made[1:]
    finally:
        for sid in made:
            b.destroy(sid)
        for snap in snaps:
            b.delete_snapshot(snap)
        b.teardown_instance()  # the storage (and every snapshot on it) goes too


if __name__ == "__main__":
    main()
