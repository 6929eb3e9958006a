"""An instance spread over several bridges (issue 20: a Linux bridge has 1023 ports).

The instance here has one port per bridge (``bridge_ports=1``): every sandbox is on a
bridge of its own, so every pair of sandboxes is a cross-bridge pair. The isolation
tests of test_local_network.py, test_local_egress.py and test_local_resolver.py (DNS,
allowlists, the SNI check's port redirect) are imported and run again against it
(their ``backend`` is this module's), and the tests below prove what only several
bridges have: the spread, the host routing nothing between bridges even when a
sandbox's frames reach it, neighbour clean-up on every bridge, and a teardown that
leaves no bridge, route or table behind.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local.config import LocalBackendConfig
from apps.sandboxes.backends.local.network import block_prefix

from .conftest import Sandbox, make_config, needs_root, new_spec, probe
from .egress_internet import Internet, internet

# The re-run isolation tests (collected here again, with this module's fixtures).
from .test_local_egress import (  # noqa: F401
    test_a_cidr_rule_opens_that_port_of_those_addresses_only,
    test_an_allowlist_never_reaches_the_host_or_other_sandboxes_even_when_listed,
)
from .test_local_network import (  # noqa: F401
    host_listener,
    outside,
    test_it_denies_egress_without_network_access_and_allows_it_with,
    test_it_refuses_sandbox_connections_to_every_host_address,
    test_it_refuses_sandbox_to_sandbox_while_the_host_reaches_both,
)
from .test_local_resolver import (  # noqa: F401
    make,
    test_all_resolves_every_name_through_the_resolver_and_none_reaches_no_dns,
    test_allowed_names_resolve_and_connect_and_nothing_else_does,
    test_match_sni_refuses_another_site_behind_an_allowed_address,
)

pytestmark = needs_root


@pytest.fixture(scope="module")
def net() -> Iterator[Internet]:
    with internet(ports=(8080, 8081, 80, 443)) as inet:
        yield inet


def _config(tmp: Path, instance: str, upstream: str) -> LocalBackendConfig:
    config = make_config(tmp, instance, "netns")
    return replace(config, bridge_ports=1, dns_upstream=upstream, dns_grace_s=2)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory, net: Internet) -> Iterator[LocalBackend]:
    b = LocalBackend(_config(tmp_path_factory.mktemp("bridges"), f"b{os.getpid()}", net.a))
    try:
        yield b
    finally:
        b.teardown_instance()


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _ports(bridge: str) -> list[str]:
    return sorted(os.listdir(f"/sys/class/net/{bridge}/brif"))


def test_blocks_are_the_largest_power_of_two_a_bridge_holds() -> None:
    net = ipaddress.IPv4Network("10.213.8.0/21")
    assert block_prefix(net, 1023) == 23  # 512 addresses: four bridges
    assert block_prefix(net, 3) == 31 and block_prefix(net, 1) == 32
    assert block_prefix(ipaddress.IPv4Network("10.213.0.0/24"), 1023) == 24  # one bridge
    for bad in (0, 1024):
        with pytest.raises(BackendError, match=f"bridge_ports={bad}: a Linux bridge holds"):
            block_prefix(net, bad)


def test_sandboxes_spread_over_bridges_of_at_most_their_ports(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    network = backend.network
    made = [sandbox_factory(network_access=i % 2 == 1) for i in range(4)]
    bridges = set()
    for sb in made:
        bridge = network.bridge_of(sb.endpoint.host)
        bridges.add(bridge)
        hv = backend.names.host_veth(sb.id)
        [link] = json.loads(_out("ip", "-d", "-j", "link", "show", "dev", hv))
        assert link["master"] == bridge
        assert link["linkinfo"]["info_slave_data"]["isolated"] is True
        assert _ports(bridge) == [hv]  # one port per bridge here
        # the host reaches it through its own bridge's route, from the gateway
        [route] = json.loads(_out("ip", "-j", "route", "get", sb.endpoint.host))
        assert (route["dev"], route["prefsrc"]) == (bridge, network.gateway), route
        assert sb.endpoint.host in network.list_neighbours()
        assert wait_healthy(sb.endpoint, sb.spec.agent_token, timeout=5)["status"] == "ok"
    assert len(bridges) == 4 and all(b.startswith(backend.names.bridge) for b in bridges)
    assert set(network.bridges()) >= bridges | {backend.names.bridge}


LISTENER = (
    "import socket\n"
    "s=socket.socket(); s.bind(('0.0.0.0',9999)); s.listen(16); print('ok',flush=True)\n"
    "while True:\n"
    "    c,_=s.accept(); c.close()\n"
)


def test_the_host_routes_nothing_between_bridges_even_frames_sent_to_it(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    """Sandboxes on two bridges share the subnet, so each takes the other as on-link and
    its ARP goes unanswered, and each netns's own filter refuses the other. Here root
    takes both of those away: ``a`` and ``b`` have neighbour entries for each other
    naming the gateway's MAC (their frames reach the host) and ``b``'s filter is gone,
    with a listener of root's in it. Only the host's forward chain is left, and it
    must route nothing from one of the instance's bridges into another."""
    a = sandbox_factory(network_access=True)
    b = sandbox_factory(network_access=True)
    network = backend.network
    assert network.bridge_of(a.endpoint.host) != network.bridge_of(b.endpoint.host)
    ns_a, ns_b = backend.names.netns(a.id), backend.names.netns(b.id)
    for ns, peer in ((ns_a, b.endpoint.host), (ns_b, a.endpoint.host)):
        _out(
            "ip", "-n", ns, "neigh", "replace", peer, "lladdr", network.bridge_mac,
            "dev", "eth0", "nud", "permanent",
        )  # fmt: skip
    _out("ip", "netns", "exec", ns_b, "nft", "delete", "table", "inet", "hedgerow")
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, sys.executable, "-c", LISTENER],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ok"
        # the host reaches the listener: a refusal below is the host's forward chain
        socket.create_connection((b.endpoint.host, 9999), timeout=2).close()
        target = f"{b.endpoint.host}:9999"
        assert probe(a, [target])[target] != "open"
    finally:
        server.kill()
        server.wait()


def test_neighbour_entries_on_any_bridge_are_listed_and_reclaimed(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    """The reconciler's view of neighbour entries spans every bridge, including an
    entry for an address outside the subnet (left from a subnet held before)."""
    sb = sandbox_factory()
    network = backend.network
    bridge = network.bridge_of(sb.endpoint.host)
    assert bridge != backend.names.bridge
    stray = "198.18.99.9"  # a benchmarking address nothing routes
    _out("ip", "neigh", "replace", stray, "lladdr", "02:68:c6:12:63:09", "dev", bridge,
         "nud", "permanent")  # fmt: skip
    assert {stray, sb.endpoint.host} <= set(network.list_neighbours())
    network.delete_neighbour(stray)
    assert stray not in network.list_neighbours()
    assert sb.endpoint.host in network.list_neighbours()


def test_a_one_bridge_instances_live_sandboxes_move_to_their_blocks_bridge(
    tmp_path: Path, net: Internet
) -> None:
    """An instance made by the one-bridge version (here: ``bridge_ports`` 1023 on a /24,
    one block) has live sandboxes anywhere in its subnet, all on the first bridge. When
    the layout splits (an upgrade; here ``bridge_ports`` 64: blocks of 64), the first
    sandbox of a block's new bridge moves the old ones of that block onto it before the
    block's route would take their traffic: they stay reachable, and their destroy
    leaves no neighbour entry behind."""
    instance = f"bu{os.getpid()}"
    old = LocalBackend(replace(_config(tmp_path, instance, net.a), bridge_ports=1023))
    new = LocalBackend(replace(_config(tmp_path, instance, net.a), bridge_ports=64))
    try:
        old.network._cursor = 68  # .70: block 1 of the split layout
        before = new_spec()
        ep = old.provision(before)
        wait_healthy(ep, before.agent_token, timeout=20)
        assert old.network.bridges() == [old.names.bridge]
        new.network._cursor = 69
        after = new_spec()
        ep2 = new.provision(after)
        wait_healthy(ep2, after.agent_token, timeout=20)
        bridge = new.network.bridge_of(ep.host)
        assert bridge == new.network.bridge_of(ep2.host) != new.names.bridge
        for sid in (before.sandbox_id, after.sandbox_id):
            hv = new.names.host_veth(sid)
            [link] = json.loads(_out("ip", "-d", "-j", "link", "show", "dev", hv))
            assert link["master"] == bridge
            assert link["linkinfo"]["info_slave_data"]["isolated"] is True
        assert wait_healthy(ep, before.agent_token, timeout=5)["status"] == "ok"
        assert sorted(new.network.list_neighbours()) == sorted([ep.host, ep2.host])
        new.destroy(before.sandbox_id)
        new.destroy(after.sandbox_id)
        assert new.network.list_neighbours() == []
    finally:
        new.teardown_instance()


def test_a_host_table_deleted_by_hand_comes_back_with_its_private_ranges(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    """ensure_instance recreates a missing host table; its sets must be filled again,
    or egress "all" reaches every private range (found: test_local_gc's teardown of
    an instance named like the session's deleted the session's tables)."""
    from apps.sandboxes.backends.local import _nft

    sandbox_factory()
    table = backend.names.nft_table
    _nft.host_run(f"delete table inet {table}\n")
    sandbox_factory()  # recreates it
    denied = _nft.host_run(f"list set inet {table} private_deny")
    assert all(n in denied for n in backend.network.private_ranges()[0]), denied


def test_teardown_leaves_no_bridge_route_or_table(tmp_path: Path, net: Internet) -> None:
    b = LocalBackend(_config(tmp_path, f"bt{os.getpid()}", net.a))
    specs = [new_spec(network_access=True), new_spec()]
    try:
        for spec in specs:
            wait_healthy(b.provision(spec), spec.agent_token, timeout=20)
        subnet = b.network.subnet
        assert len(b.network.bridges()) == 3  # the gateway's and one per sandbox
        for spec in specs:
            b.destroy(spec.sandbox_id)
    finally:
        b.teardown_instance()
    links = os.listdir("/sys/class/net")
    assert [n for n in links if n.startswith(b.names.bridge)] == []
    routes = json.loads(_out("ip", "-j", "-4", "route", "show", "table", "all"))
    leaked = [
        r
        for r in routes
        if r.get("dst", "default") != "default"
        and ipaddress.IPv4Network(r["dst"], strict=False).overlaps(subnet)
    ]
    assert leaked == []
    tables = _out("nft", "list", "tables")
    assert b.names.nft_table not in tables
