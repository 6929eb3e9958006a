"""Address claims: O_EXCL files under the state dir, found in O(1) from a cursor.

Only files: no interface or address is created (a TEST-NET-2 /29 that nothing on
this machine routes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local.config import LocalBackendConfig, Names
from apps.sandboxes.backends.local.network import Network

from .conftest import PODAGENT

pytestmark = pytest.mark.skipif(shutil.which("ip") is None, reason="needs ip")

SUBNET = "198.51.100.0/29"  # .1 bridge, .2-.6 sandboxes, .7 broadcast


def network(tmp_path: Path) -> Network:
    config = LocalBackendConfig(
        state_dir=tmp_path / "state",
        instance="addr",
        podagent_dir=PODAGENT,
        subnet=SUBNET,
        claims_dir=tmp_path / "subnets",
    )
    config.state_dir.mkdir(parents=True, exist_ok=True)
    return Network(config, Names("addr"))


def test_it_claims_every_address_once_then_refuses(tmp_path: Path) -> None:
    net = network(tmp_path)
    got = [net.claim_ip(f"s{i}") for i in range(5)]
    assert sorted(got) == [f"198.51.100.{n}" for n in range(2, 7)]
    with pytest.raises(BackendError, match="no free address") as exc:
        net.claim_ip("s5")
    assert exc.value.transient
    assert sorted(net.claims()) == sorted((ip, f"s{i}") for i, ip in enumerate(got))


def test_it_reuses_a_released_address_last(tmp_path: Path) -> None:
    net = network(tmp_path)
    first, second = net.claim_ip("a"), net.claim_ip("b")
    net.release_ips("a", first)
    third = net.claim_ip("c")
    assert third not in (first, second)
    for sid in "def":
        net.claim_ip(sid)  # .5, .6, then wraps round to the released one
    assert ("198.51.100.2", "f") in net.claims()


def test_it_never_hands_out_an_address_another_process_holds(tmp_path: Path) -> None:
    worker_a, worker_b = network(tmp_path), network(tmp_path)  # one state dir, two cursors
    got = [w.claim_ip(f"s{i}") for i, w in enumerate([worker_a, worker_b] * 2 + [worker_a])]
    assert len(set(got)) == 5
    with pytest.raises(BackendError):
        worker_b.claim_ip("s5")


def test_it_releases_only_the_sandboxes_own_claims(tmp_path: Path) -> None:
    net = network(tmp_path)
    mine, theirs = net.claim_ip("mine"), net.claim_ip("theirs")
    net.release_ips("mine", theirs)  # a wrong hint: falls back to reading every claim
    assert net.claims() == [(theirs, "theirs")]
    net.release_ips("theirs")  # no hint
    assert net.claims() == []
    assert mine != theirs
