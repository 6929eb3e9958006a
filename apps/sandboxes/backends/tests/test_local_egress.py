"""Egress policies of the local backend, proven with real connection attempts from
sandboxes into a namespace the test builds (egress_internet.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from apps.core.egress import parse_egress
from apps.sandboxes.backends.local import LocalBackend

from .conftest import Sandbox, host_ipv4_addresses, needs_root, probe
from .egress_internet import Internet, internet

pytestmark = needs_root


@pytest.fixture(scope="module")
def net() -> Iterator[Internet]:
    with internet() as inet:
        yield inet


def test_a_cidr_rule_opens_that_port_of_those_addresses_only(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, net: Internet
) -> None:
    quad = f"{net.c}/30"  # .4-.7: only c of the listeners
    policy = parse_egress({"allow": [f"{net.a}:8080", f"{quad}:8081"]})
    sb = sandbox_factory(network_access=True, egress=policy)
    targets = [f"{h}:{p}" for h in (net.a, net.b, net.c, net.link_local) for p in (8080, 8081)]
    got = probe(sb, targets)
    opened = {t for t, result in got.items() if result == "open"}
    assert opened == {f"{net.a}:8080", f"{net.c}:8081"}, got
    assert set(got) == set(targets), got
    # refused at once (an ICMP admin-prohibited), not a hang until a timeout
    assert got[f"{net.b}:8080"] in ("EHOSTUNREACH", "ECONNREFUSED", "EACCES"), got
    # the elements are the sandbox's own and go with it
    assert sorted(backend.network._elements("allow_net")) == sorted(
        [f"{sb.endpoint.host} . {net.a} . 8080", f"{sb.endpoint.host} . {quad} . 8081"]
    )
    backend.destroy(sb.id)
    assert backend.network._elements("allow_net") == []


@pytest.mark.parametrize("egress", ["none", "all", "allow"])
def test_link_local_addresses_are_refused_under_every_policy(
    sandbox_factory: Callable[..., Sandbox], net: Internet, egress: str
) -> None:
    policy = parse_egress(egress if egress != "allow" else {"allow": [f"{net.a}:8080"]})
    sb = sandbox_factory(network_access=egress != "none", egress=policy)
    got = probe(sb, [f"{net.link_local}:8080", f"{net.a}:8080"])
    # routed (all, allow): the refusal is the rule's; "none" reaches nothing at all
    assert (got[f"{net.a}:8080"] == "open") == (egress != "none"), got
    assert got[f"{net.link_local}:8080"] != "open", got


def test_all_refuses_private_ranges_the_operator_did_not_list(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, net: Internet
) -> None:
    """egress "all" reaches public addresses and the private ranges the operator listed
    (the test internet's 10.216/16, make_config), never another private range; an
    allowlist reaches a private address only by listing it."""
    denied, allowed = backend.network.private_ranges()
    assert "172.16.0.0/12" in denied and "10.216.0.0/16" in allowed
    everything = parse_egress("all")
    sb = sandbox_factory(network_access=True, egress=everything)
    got = probe(sb, [f"{net.private}:8080", f"{net.a}:8080"])
    assert got[f"{net.a}:8080"] == "open", got  # routed, and the listed range passes
    # refused at once (admin-prohibited), not a hang
    assert got[f"{net.private}:8080"] in ("EHOSTUNREACH", "ECONNREFUSED", "EACCES"), got
    listed = parse_egress({"allow": [f"{net.private}/32:8080"]})
    sb2 = sandbox_factory(network_access=True, egress=listed)
    got = probe(sb2, [f"{net.private}:8080", f"{net.private}:8081"])
    assert got[f"{net.private}:8080"] == "open", got
    assert got[f"{net.private}:8081"] != "open", got


def test_a_live_policy_change_takes_effect_for_new_connections(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, net: Internet
) -> None:
    sb = sandbox_factory()  # egress "none"
    targets = [f"{net.a}:8080", f"{net.b}:8080"]

    def opened() -> set[str]:
        return {t for t, result in probe(sb, targets).items() if result == "open"}

    assert opened() == set()
    backend.set_egress(sb.id, parse_egress({"allow": [f"{net.a}:8080"]}))
    assert opened() == {f"{net.a}:8080"}
    backend.set_egress(sb.id, parse_egress({"allow": [f"{net.b}:8080"]}))
    assert opened() == {f"{net.b}:8080"}
    assert backend.network._elements("allow_net") == [f"{sb.endpoint.host} . {net.b} . 8080"]
    backend.set_egress(sb.id, parse_egress("all"))
    assert opened() == set(targets)
    assert backend.network._elements("allow_net") == []
    backend.set_egress(sb.id, parse_egress("none"))
    assert opened() == set()
    assert sb.endpoint.host not in backend.network.list_egress()


def test_an_allowlist_never_reaches_the_host_or_other_sandboxes_even_when_listed(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, net: Internet
) -> None:
    import json
    import socket
    import subprocess
    import threading

    other = sandbox_factory()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    port = int(srv.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                srv.accept()[0].close()
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        # the gateway and the host's main address (other addresses come and go with
        # other tests' namespaces; test_local_network.py covers every one)
        gateway = backend.network.gateway
        route = subprocess.run(
            ["ip", "-j", "route", "get", "192.0.2.1"], capture_output=True, text=True, check=True
        )
        main = json.loads(route.stdout)[0]["prefsrc"]
        assert main in host_ipv4_addresses()
        hosts = sorted({gateway, main})
        allow = [f"{h}:{port}" for h in hosts]
        allow += [f"{backend.network.subnet}:{backend.config.agent_port}", f"{net.a}:8080"]
        sb = sandbox_factory(network_access=True, egress=parse_egress({"allow": allow}))
        for h in hosts:  # the listener is up on every one of them (from the host)
            socket.create_connection((h, port), timeout=2).close()
        targets = [f"{h}:{port}" for h in hosts]
        targets += [f"{other.endpoint.host}:{backend.config.agent_port}", f"{net.a}:8080"]
        got = probe(sb, targets)
        assert got[f"{net.a}:8080"] == "open", got  # the policy works; the rest is refused
        assert {t for t, r in got.items() if r == "open"} == {f"{net.a}:8080"}, got
    finally:
        stop.set()
        thread.join()
        srv.close()


def test_leftover_allowlist_elements_are_listed_reclaimed_and_never_inherited(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, net: Internet
) -> None:
    from apps.sandboxes.backends.local import _nft

    sandbox_factory()  # the instance's tables exist
    table = backend.network.names.nft_table
    # what a sandbox whose meta.json was lost leaves: elements of an unclaimed address
    lost = str(backend.network.subnet.broadcast_address - 1)

    def leave() -> None:
        _nft.host_run(
            f"add element inet {table} allowlisted {{ {lost} }}\n"
            f"add element inet {table} allow_net {{ {lost} . {net.b} . 8080 }}\n"
            f"add element inet {table} allow_dst {{ {lost} . {net.c} timeout 300s }}\n"
        )

    leave()
    items = [i for i in backend.inventory() if i.name == f"allow:{lost}"]
    assert [(i.kind, i.sandbox_id) for i in items] == [("nft_rule", None)]
    backend.reclaim(items[0])
    assert lost not in backend.network.list_allowlisted()
    # an allowlist provisioned on such an address (apply_policy with no old policy, as
    # provision calls it) starts from its own elements only
    leave()
    backend.network.apply_policy(lost, parse_egress({"allow": [f"{net.a}:8080"]}), None)
    assert [e for e in backend.network._elements("allow_net") if e.startswith(lost)] == [
        f"{lost} . {net.a} . 8080"
    ]
    assert not [e for e in backend.network._elements("allow_dst") if e.startswith(lost)]
    backend.network.delete_allowlist(lost, None)
    assert lost not in backend.network.list_allowlisted()


OLD_INET = """
table inet {t} {{
  set egress {{ type ipv4_addr; }}
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname "{br}" ct state established,related accept
    iifname "{br}" drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{br}" oifname "{br}" drop
    iifname "{br}" ip saddr @egress ip daddr != {sub} accept
    iifname "{br}" drop
    oifname "{br}" ct state established,related accept
    oifname "{br}" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr @egress oifname != "{br}" masquerade
  }}
}}
"""


def test_a_host_table_of_the_previous_version_is_upgraded_in_place(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, net: Internet
) -> None:
    from apps.sandboxes.backends.local import _nft

    sandbox_factory()  # the instance's tables exist
    network = backend.network
    t, br, sub = network.names.nft_table, network.names.bridge, network.subnet
    kept = str(sub.broadcast_address - 2)  # an "all" sandbox's element: must survive
    _nft.host_run(
        f"delete table inet {t}\n"
        + OLD_INET.format(t=t, br=br, sub=sub)
        + f"add element inet {t} egress {{ {kept} }}\n"
    )
    network._tables_current = False
    network.ensure_instance()
    try:
        assert kept in network.list_egress()
        assert network.list_allowlisted() == []  # the set exists now
        sb = sandbox_factory(network_access=True, egress=parse_egress({"allow": [f"{net.a}:8080"]}))
        got = probe(sb, [f"{net.a}:8080", f"{net.b}:8080"])
        assert {k for k, v in got.items() if v == "open"} == {f"{net.a}:8080"}, got
    finally:
        network.delete_egress(kept)
