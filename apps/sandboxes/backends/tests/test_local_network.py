"""Network isolation of the local backend, proven with real connection attempts.

Every target is on this machine: the host's own addresses, loopback, sandboxes,
or a namespace this test creates. No traffic ever leaves the machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from apps.sandboxes.backends.local import LocalBackend, wait_healthy

from .conftest import Sandbox, host_ipv4_addresses, needs_root, probe

pytestmark = needs_root


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP service on 0.0.0.0 like Postgres/Redis/web: sandboxes must not reach it."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield int(srv.getsockname()[1])
    stop.set()
    t.join()
    srv.close()


OUTSIDE_SERVER = (
    "import socket\n"
    "s=socket.socket(); s.bind(('0.0.0.0',8080)); s.listen(16); print('ok',flush=True)\n"
    "while True:\n"
    "    c,_=s.accept(); c.close()\n"
)


@pytest.fixture
def outside() -> Iterator[str]:
    """A stand-in for 'the internet': a netns of our own on a private /30, with a listener."""
    tag = f"hro{os.getpid() % 100000}"
    third = os.getpid() % 250
    host_ip, ns_ip = f"10.214.{third}.1", f"10.214.{third}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", tag)
    server = None
    try:
        ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b", "netns", tag)
        ip("addr", "add", f"{host_ip}/30", "dev", f"{tag}a")
        ip("link", "set", f"{tag}a", "up")
        ip("-n", tag, "addr", "add", f"{ns_ip}/30", "dev", f"{tag}b")
        ip("-n", tag, "link", "set", f"{tag}b", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", tag, sys.executable, "-c", OUTSIDE_SERVER],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ok"
        # the host reaches it: a failure from a sandbox is the sandbox's isolation
        socket.create_connection((ns_ip, 8080), timeout=2).close()
        yield f"{ns_ip}:8080"
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)


# network_access=True removes the in-netns layer (route + output drop), so the
# host-side layers (host input chain, bridge isolation) are proven on their own.
@pytest.mark.parametrize("network_access", [False, True])
def test_it_refuses_sandbox_connections_to_every_host_address(
    sandbox_factory: Callable[..., Sandbox],
    backend: LocalBackend,
    host_listener: int,
    network_access: bool,
) -> None:
    sb = sandbox_factory(network_access=network_access)
    gateway = backend.network.gateway
    targets = [f"{a}:{host_listener}" for a in {gateway, *host_ipv4_addresses()}]
    # the listener really is up on those addresses (from the host)
    for t in targets:
        h, p = t.rsplit(":", 1)
        socket.create_connection((h, int(p)), timeout=2).close()
    results = probe(sb, [*targets, f"127.0.0.1:{host_listener}", f"{gateway}:22"])
    assert results, "probe printed nothing"
    assert all(v != "open" for v in results.values()), results


@pytest.mark.parametrize("network_access", [False, True])
def test_it_refuses_sandbox_to_sandbox_while_the_host_reaches_both(
    sandbox_factory: Callable[..., Sandbox],
    network_access: bool,
) -> None:
    a = sandbox_factory(network_access=network_access)
    b = sandbox_factory(network_access=network_access)
    for sb in (a, b):
        assert wait_healthy(sb.endpoint, sb.spec.agent_token, timeout=5)["status"] == "ok"
    results = probe(a, [f"{b.endpoint.host}:{b.endpoint.port}"])
    assert results[f"{b.endpoint.host}:{b.endpoint.port}"] != "open", results
    assert (
        probe(b, [f"{a.endpoint.host}:{a.endpoint.port}"])[f"{a.endpoint.host}:{a.endpoint.port}"]
        != "open"
    )


def test_it_denies_egress_without_network_access_and_allows_it_with(
    sandbox_factory: Callable[..., Sandbox],
    outside: str,
    backend: LocalBackend,
    host_listener: int,
) -> None:
    closed = sandbox_factory(network_access=False)
    assert probe(closed, [outside])[outside] != "open"
    # no default route inside: the kernel reports it before any packet is sent
    _, out, _ = closed.sh("cat /proc/net/route")
    destinations = [line.split()[1] for line in out.splitlines()[1:] if line.strip()]
    assert destinations and "00000000" not in destinations, out

    opened = sandbox_factory(network_access=True)
    assert probe(opened, [outside])[outside] == "open"
    # egress does not open the host itself
    target = f"{backend.network.gateway}:{host_listener}"
    assert probe(opened, [target])[target] != "open"


def test_it_keeps_host_side_rules_in_one_table_per_instance(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    sandbox_factory()
    tables = subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=True
    ).stdout
    assert f"table inet {backend.names.nft_table}" in tables
    assert f"table bridge {backend.names.nft_table}" in tables


def test_it_builds_the_network_that_ip_and_nft_see(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    """The in-process setup (netlink, libnftables) leaves what `ip`/`nft` would: operators,
    gc and the agent launch (`ip netns exec`) rely on it."""
    own_netns = os.readlink("/proc/thread-self/ns/net")
    sb = sandbox_factory(network_access=False)
    assert os.readlink("/proc/thread-self/ns/net") == own_netns  # never switched

    ns, hv = backend.names.netns(sb.id), backend.names.host_veth(sb.id)

    def out(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    assert ns in out("ip", "netns", "list")
    [host] = json.loads(out("ip", "-d", "-j", "link", "show", "dev", hv))
    assert host["master"] == backend.names.bridge
    assert host["ifalias"] == backend.names.veth_alias(sb.id)
    assert host["linkinfo"]["info_slave_data"]["isolated"] is True
    assert "UP" in host["flags"]
    [inner] = json.loads(out("ip", "-n", ns, "-j", "addr", "show", "dev", "eth0"))
    assert [(a["local"], a["prefixlen"]) for a in inner["addr_info"] if a["family"] == "inet"] == [
        (sb.endpoint.host, backend.network.subnet.prefixlen)
    ]
    assert "UP" in inner["flags"]
    assert json.loads(out("ip", "-n", ns, "-j", "route", "show", "default")) == []
    ruleset = json.loads(out("ip", "netns", "exec", ns, "nft", "-j", "list", "ruleset"))
    chains = {c["chain"]["name"]: c["chain"]["policy"] for c in ruleset["nftables"] if "chain" in c}
    assert chains == {"input": "drop", "output": "drop"}


def conntrack_entries(backend: LocalBackend, sb: Sandbox) -> int:
    ns = backend.names.netns(sb.id)
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", "/proc/sys/net/netfilter/nf_conntrack_count"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out)


def test_it_tracks_no_connections_in_a_sandbox_without_network_access(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend, outside: str
) -> None:
    closed = sandbox_factory(network_access=False)
    opened = sandbox_factory(network_access=True)
    for sb in (closed, opened):
        assert sb.sh("echo hi") == (0, "hi\n", "")  # connections to the agent
    assert probe(opened, [outside])[outside] == "open"
    # a netns with conntrack entries costs its teardown a walk of the whole table
    assert conntrack_entries(backend, closed) == 0
    assert conntrack_entries(backend, opened) > 0  # stateful: replies to its own
    # the stateless output rule lets out only the agent's port, which no command can
    # take from its listener (with SO_REUSEADDR too)
    port = closed.endpoint.port
    bind = (
        "import socket; s = socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('0.0.0.0', {port}))"
    )
    code, _, err = closed.sh(f'python3 -c "{bind}"')
    assert code != 0 and "Address already in use" in err, err


def test_it_gives_sandbox_links_no_ipv6_but_keeps_loopback(
    sandbox_factory: Callable[..., Sandbox], backend: LocalBackend
) -> None:
    sb = sandbox_factory()
    _, out, _ = sb.sh("cat /proc/net/if_inet6")
    assert [line.split()[-1] for line in out.splitlines()] == ["lo"], out  # ::1 only
    assert (
        sb.sh("python3 -c \"import socket; socket.socket(socket.AF_INET6).bind(('::1', 0))\"")[0]
        == 0
    )
    host_end = Path(f"/proc/sys/net/ipv6/conf/{backend.names.host_veth(sb.id)}/disable_ipv6")
    assert host_end.read_text().strip() == "1"


def test_it_leaves_ipv6_on_rather_than_fail_where_proc_sys_is_read_only() -> None:
    # a throwaway mount and network namespace: the host's settings are never touched
    script = (
        "import apps.sandboxes.backends.local.network as n; "
        "n._disable_ipv6('default'); "
        "print(open('/proc/sys/net/ipv6/conf/default/disable_ipv6').read().strip())"
    )
    shell = (
        "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && "
        'exec "$0" -c "$1"'
    )
    done = subprocess.run(
        ["unshare", "-m", "-n", "sh", "-c", shell, sys.executable, script],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[4]),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"  # left on, and said so
    assert "cannot disable IPv6" in done.stderr


def test_it_owns_a_veth_caught_before_its_alias_by_its_far_end_netns(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    """A veth is created without its alias (the kernel takes none at creation) and gets
    it a moment later. A reconciler listing in that moment must still see whose it is,
    or it reclaims a starting sandbox's veth as an unparseable orphan."""
    sb = sandbox_factory(network_access=False)
    hv = backend.names.host_veth(sb.id)
    subprocess.run(["ip", "link", "set", "dev", hv, "alias", ""], check=True)
    [host] = json.loads(
        subprocess.run(
            ["ip", "-d", "-j", "link", "show", "dev", hv], capture_output=True, text=True
        ).stdout
    )
    assert not host.get("ifalias"), "the alias must be gone for this test to mean anything"

    assert (hv, sb.id) in backend.network.list_veths()
    veths = [item for item in backend.inventory() if item.kind == "veth"]
    assert [(item.name, item.sandbox_id) for item in veths] == [(hv, sb.id)]

    # Ours by its prefix, but with no sandbox netns at the far end: a real orphan.
    stray, peer = backend.names.veth_prefix + "stray0", f"hrsp{os.getpid() % 10**8}"
    subprocess.run(["ip", "link", "add", stray, "type", "veth", "peer", "name", peer], check=True)
    try:
        assert (stray, None) in backend.network.list_veths()
        assert (hv, sb.id) in backend.network.list_veths()
    finally:
        subprocess.run(["ip", "link", "del", stray], check=False)
