"""Garbage-collects what dead test and benchmark runs left on the machine.

A test run's instance owns a bridge, host nft tables, a cgroup group and a /24 claim
from a pool of 256. A run killed before its teardown (a crash, a timeout, a CI job
stopped) leaves them behind, and enough of those exhaust the pool. Kernel state
outlives processes, so `make test` calls this first.

Only instances that are provably dead are touched: the run's directory is gone, or
the instance is named after a process id (``t123``, ``pytest123``, ``bench123``,
``lc123``) that is no longer running. Claims younger than ``min_age_s`` are left alone
so a run that is just starting is never disturbed.

Usage: ``python -m apps.sandboxes.backends.local.gc [--min-age SECONDS]``
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local import idmap
from apps.sandboxes.backends.local.backend import LocalBackend
from apps.sandboxes.backends.local.config import LocalBackendConfig

CLAIMS_DIR = Path("/run/hedgerow/subnets")
PID_NAMED = re.compile(r"^(?:t|pytest|bench|lc)(\d+)$")
PODAGENT_DIR = Path(__file__).resolve().parents[4] / "podagent"


def _dead(instance: str, state_dir: Path) -> bool:
    if not state_dir.exists():
        return True
    match = PID_NAMED.match(instance)
    if match is None:
        return False
    return not Path(f"/proc/{match.group(1)}").exists()


def stale_instances(
    claims_dir: Path = CLAIMS_DIR, min_age_s: float = 600.0
) -> list[tuple[str, Path]]:
    """(instance, state_dir) of every claim whose owner is provably dead."""
    found: list[tuple[str, Path]] = []
    if not claims_dir.is_dir():
        return found
    now = time.time()
    for claim in claims_dir.iterdir():
        try:
            instance, state = claim.read_text().split()[:2]
            age = now - claim.stat().st_mtime
        except (OSError, ValueError):
            continue
        if age >= min_age_s and _dead(instance, Path(state)):
            found.append((instance, Path(state)))
    return found


def collect(claims_dir: Path = CLAIMS_DIR, min_age_s: float = 600.0) -> list[str]:
    """Tears down every stale instance; returns their names."""
    removed = []
    for instance, state_dir in stale_instances(claims_dir, min_age_s):
        state_dir.mkdir(parents=True, exist_ok=True)
        backend = LocalBackend(
            LocalBackendConfig(
                state_dir=state_dir,
                instance=instance,
                podagent_dir=PODAGENT_DIR,
                claims_dir=claims_dir,
            )
        )
        try:
            backend.teardown_instance()
        except BackendError:
            continue
        removed.append(instance)
    idmap.release_orphans(claims_dir)
    return removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-age", type=float, default=600.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        return  # nothing of this kind exists without root
    removed = collect(min_age_s=args.min_age)
    if removed:
        print(f"removed {len(removed)} stale sandbox instance(s) left by dead runs")


if __name__ == "__main__":
    main()
