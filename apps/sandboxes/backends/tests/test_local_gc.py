"""Stale instances of dead runs are torn down; live or young ones are never touched."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from apps.sandboxes.backends.local import gc
from apps.sandboxes.backends.local.backend import LocalBackend

from .conftest import make_config, needs_root, new_spec, searchable

pytestmark = needs_root


def _backend(state: Path, instance: str, claims: Path) -> LocalBackend:
    return LocalBackend(replace(make_config(state, instance, "netns"), claims_dir=claims))


def _age(claims_dir: Path, seconds: float) -> None:
    old = time.time() - seconds
    for claim in claims_dir.iterdir():
        os.utime(claim, (old, old))


def test_it_tears_down_a_dead_runs_instance_and_keeps_a_live_one(tmp_path: Path) -> None:
    claims = searchable(tmp_path) / "claims"  # its parent holds pause: bound into sandboxes
    dead_state, live_state = tmp_path / "dead", tmp_path / "live"
    # A pid that cannot be running: beyond pid_max.
    dead = _backend(dead_state, "t99999999", claims)
    # named after this (live) process, but not the session backend's t<pid>: the same
    # name is the same bridge and host tables, which this test's teardown deletes
    live = _backend(live_state, f"pytest{os.getpid()}", claims)
    spec = new_spec()
    try:
        dead.provision(spec)
        live.provision(new_spec())
        _age(claims, 3600)
        assert [name for name, _ in gc.stale_instances(claims, 600)] == ["t99999999"]
        assert gc.collect(claims, 600) == ["t99999999"]
        assert dead.inventory() == []
        assert [c.name for c in claims.iterdir()] == [str(live.network.subnet.network_address)]
        assert live.inventory(), "the live run's sandbox must be untouched"
        # the dead run's sandbox storage is unmounted and deleted, the live one's kept
        assert dead.storage is not None and live.storage is not None
        assert not dead.storage.mounted() and not dead.storage.image.exists()
        assert live.storage.mounted()
    finally:
        live.teardown_instance()
        dead.teardown_instance()


def test_it_leaves_young_claims_alone(tmp_path: Path) -> None:
    claims = searchable(tmp_path) / "claims"  # its parent holds pause: bound into sandboxes
    young = _backend(tmp_path / "young", "t99999998", claims)
    try:
        young.provision(new_spec())
        assert gc.stale_instances(claims, 600) == []
    finally:
        young.teardown_instance()
