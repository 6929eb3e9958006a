"""``LocalBackend.prepare``: what a worker makes as it starts, so the first provisions of
a burst on a fresh instance do not each build it (issue 17 goal 1)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.tests.conftest import make_config, needs_root, new_spec


@pytest.fixture
def fresh_backend(tmp_path: Path) -> Iterator[LocalBackend]:
    backend = LocalBackend(make_config(tmp_path, f"pr{os.getpid()}{uuid.uuid4().hex[:4]}"))
    try:
        yield backend
    finally:
        backend.teardown_instance()


@needs_root
def test_prepare_starts_the_zygote_and_claims_the_network_before_any_provision(
    fresh_backend: LocalBackend,
) -> None:
    assert fresh_backend.zygote.ping() is None
    assert not fresh_backend.network.subnet_file.exists()
    fresh_backend.prepare()
    answer = fresh_backend.zygote.ping()
    assert answer is not None and fresh_backend.agent_launch == "zygote"
    assert fresh_backend.network.subnet_file.exists()
    fresh_backend.prepare()  # idempotent: the same zygote, the same subnet
    again = fresh_backend.zygote.ping()
    assert again is not None and again["pid"] == answer["pid"]
    spec = new_spec()
    wait_healthy(fresh_backend.provision(spec), spec.agent_token, timeout=20)
    after = fresh_backend.zygote.ping()
    assert after is not None and after["pid"] == answer["pid"]  # the agent came from it
