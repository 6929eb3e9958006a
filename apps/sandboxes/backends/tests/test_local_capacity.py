"""How many sandboxes an instance can hold: its subnet's size (HEDGEROW_LOCAL_SUBNET_PREFIX,
`make up` asks for a /21), spread over bridges of at most 1023 ports, with errors that
name the limit. Only claim files: no interface is created (benchmarking ranges, 198.18.0.0/15,
that nothing on this machine routes)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local.config import LocalBackendConfig, Names
from apps.sandboxes.backends.local.network import BRIDGE_MAX_PORTS, Network, usable_addresses

from .conftest import PODAGENT


def network(tmp_path: Path, instance: str = "cap", **config: object) -> Network:
    """An instance's network claims under ``tmp_path`` (its state dir named after it),
    sharing the machine-wide claims dir with every other instance made here."""
    cfg = LocalBackendConfig(
        state_dir=tmp_path / instance,
        instance=instance,
        podagent_dir=PODAGENT,
        claims_dir=tmp_path / "subnets",
        **config,  # type: ignore[arg-type]
    )
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    return Network(cfg, Names(instance))


def test_a_pool_instance_claims_a_subnet_of_the_configured_size(tmp_path: Path) -> None:
    net = network(tmp_path, subnet_pool="198.18.0.0/16", subnet_prefix=22)
    subnet = net.subnet
    assert subnet.prefixlen == 22 and subnet.subnet_of(ipaddress.IPv4Network("198.18.0.0/16"))
    assert usable_addresses(subnet) == 1021
    # a second instance on the machine gets a different /22
    other = network(tmp_path, "cap2", subnet_pool="198.18.0.0/16", subnet_prefix=22)
    assert not other.subnet.overlaps(subnet)


@pytest.mark.parametrize("prefix", [12, 29])
def test_a_prefix_outside_the_pool_or_too_small_is_refused_by_name(
    tmp_path: Path, prefix: int
) -> None:
    net = network(tmp_path, subnet_pool="198.18.0.0/16", subnet_prefix=prefix)
    with pytest.raises(BackendError, match=f"HEDGEROW_LOCAL_SUBNET_PREFIX={prefix}"):
        net.subnet  # noqa: B018 (the property claims)


def test_an_exhausted_pool_says_what_frees_it(tmp_path: Path) -> None:
    network(tmp_path, subnet_pool="198.18.0.0/23", subnet_prefix=23).subnet  # noqa: B018
    second = network(tmp_path, "cap2", subnet_pool="198.18.0.0/23", subnet_prefix=23)
    with pytest.raises(BackendError, match=r"no free /23 left in 198\.18\.0\.0/23.*gc"):
        second.subnet  # noqa: B018


def test_a_subnet_larger_than_a_bridge_holds_all_its_addresses(tmp_path: Path) -> None:
    net = network(tmp_path, subnet="198.18.8.0/21")  # 2045 addresses; bridges of 512
    assert usable_addresses(net.subnet) == 2045 > BRIDGE_MAX_PORTS
    got = {net.claim_ip(f"s{i}") for i in range(2045)}
    assert len(got) == 2045
    per_bridge: dict[int, int] = {}
    for ip in got:
        per_bridge[net.bridge_index(ip)] = per_bridge.get(net.bridge_index(ip), 0) + 1
    assert per_bridge == {0: 510, 1: 512, 2: 512, 3: 511}  # none above BRIDGE_MAX_PORTS
    with pytest.raises(BackendError, match=r"at most 2045 live sandboxes \(a /21") as e:
        net.claim_ip("one-too-many")
    assert e.value.transient  # capacity frees as sandboxes end: admission retries


def test_a_full_small_subnet_names_the_setting_that_grows_it(tmp_path: Path) -> None:
    net = network(tmp_path, subnet="198.18.16.0/29")  # 5 sandboxes
    for i in range(5):
        net.claim_ip(f"s{i}")
    with pytest.raises(
        BackendError, match=r"at most 5 live sandboxes.*HEDGEROW_LOCAL_SUBNET_PREFIX"
    ):
        net.claim_ip("s5")
