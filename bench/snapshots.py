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

Prints ratios, not pass/fail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from apps.sandboxes.backends.base import SandboxSpec
from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, wait_healthy

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="0,10,100", help="MiB of changed state, comma-separated")
    p.add_argument("--fork", type=int, default=16)
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
    try:
        warm = _spec()
        made.append(warm.sandbox_id)
        _start(b, warm)  # zygote, storage, network: warm
        assert b.storage is not None
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
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda c: _start(b, c), children))
            fork_s = time.perf_counter() - t0
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
