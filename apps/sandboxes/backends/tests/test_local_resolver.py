"""The instance's resolver and the allowlist by name, proven from inside sandboxes:
real lookups through the sandbox's libc, real connections, into a namespace the test
builds (egress_internet.py: an upstream DNS server for a test zone and listeners)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from apps.core.egress import parse_egress
from apps.sandboxes.backends.local import LocalBackend, wait_healthy

from .conftest import Sandbox, make_config, needs_root, new_spec, probe
from .egress_internet import Internet, internet

pytestmark = needs_root

GRACE = 2


@pytest.fixture(scope="module")
def net() -> Iterator[Internet]:
    with internet(ports=(8080, 8081, 80, 443)) as inet:
        yield inet


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory, net: Internet) -> Iterator[LocalBackend]:
    from dataclasses import replace

    config = make_config(tmp_path_factory.mktemp("dns"), f"d{os.getpid()}", "netns")
    b = LocalBackend(replace(config, dns_upstream=net.a, dns_grace_s=GRACE))
    try:
        yield b
    finally:
        b.teardown_instance()


@pytest.fixture
def make(backend: LocalBackend) -> Iterator[Callable[[Any], Sandbox]]:
    made: list[str] = []

    def create(egress: Any) -> Sandbox:
        spec = new_spec(network_access=True, egress=parse_egress(egress))
        made.append(spec.sandbox_id)
        endpoint = backend.provision(spec)
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        return Sandbox(backend, spec, endpoint)

    yield create
    for sid in made:
        backend.destroy(sid)


# Resolve with the sandbox's libc (its /etc/resolv.conf), then connect: prints
# "<target> open <address>", "<target> resolve:<gai error>" or "<target> <errno name>".
NAMES = (
    "import socket,sys,errno\n"
    "for t in sys.argv[1:]:\n"
    "    h,p=t.rsplit(':',1)\n"
    "    try:\n"
    "        a=socket.getaddrinfo(h,int(p),socket.AF_INET,socket.SOCK_STREAM)[0][4][0]\n"
    "    except socket.gaierror as e:\n"
    "        print(t,'resolve:'+str(e.errno)); continue\n"
    "    s=socket.socket(); s.settimeout(3)\n"
    "    try:\n"
    "        s.connect((a,int(p))); print(t,'open',a)\n"
    "    except OSError as e:\n"
    "        print(t, errno.errorcode.get(e.errno or 0, str(e)))\n"
    "    finally:\n"
    "        s.close()\n"
)

# Raw DNS queries: "<server> <name> <type> <count>" → one line per answer's rcode, or
# "none" when nothing came back.
RAW = (
    "import socket,struct,sys,random\n"
    "server,name,qtype,count=sys.argv[1],sys.argv[2],int(sys.argv[3]),int(sys.argv[4])\n"
    "q=b''.join(bytes([len(l)])+l.encode() for l in name.split('.'))+b'\\0'\n"
    "for i in range(count):\n"
    "    s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.settimeout(1.5)\n"
    "    qid=random.randrange(65536)\n"
    "    try:\n"
    "        s.connect((server,53))\n"
    "        s.send(struct.pack('!HHHHHH',qid,0x100,1,0,0,0)+q+struct.pack('!HH',qtype,1))\n"
    "        print(s.recv(4096)[3]&15)\n"
    "    except OSError:\n"
    "        print('none')\n"
    "    finally:\n"
    "        s.close()\n"
)


def lookup(sb: Sandbox, targets: list[str]) -> dict[str, str]:
    r = sb.exec(["python3", "-c", NAMES, *targets], timeout=60)
    assert r["termination"]["exit_code"] == 0, r
    return dict(line.split(" ", 1) for line in r["stdout"]["head"].splitlines() if line)


def raw(sb: Sandbox, server: str, name: str, qtype: int = 1, count: int = 1) -> list[str]:
    r = sb.exec(["python3", "-c", RAW, server, name, str(qtype), str(count)], timeout=90)
    assert r["termination"]["exit_code"] == 0, r
    return str(r["stdout"]["head"]).split()


def asked(
    backend: LocalBackend, sid: str, since: int = 0
) -> list[tuple[str, str, bool, list[str]]]:
    """The log from entry ``since`` on (the agent's own lookups at start come first)."""
    return [
        (e["name"], e["type"], e["allowed"], [a["address"] for a in e["answer"]])
        for e in backend.dns_log(sid)[since:]
    ]


def test_allowed_names_resolve_and_connect_and_nothing_else_does(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    sb = make({"allow": ["allowed.test", "*.wild.test"]})
    before = len(backend.dns_log(sb.id))
    got = lookup(
        sb,
        [
            "allowed.test:8080",
            "blocked.test:8080",
            "x.wild.test:8081",
            "wild.test:8080",  # a wildcard is below the name, not the name
            f"{net.b}:8080",  # blocked.test's address, directly
            f"{net.c}:8080",  # x.wild.test's: allowed by the answer, any TCP port
        ],
    )
    assert got["allowed.test:8080"] == f"open {net.a}", got
    assert got["blocked.test:8080"] == "resolve:-2", got  # EAI_NONAME: NXDOMAIN
    assert got["x.wild.test:8081"] == f"open {net.c}", got
    assert got["wild.test:8080"] == "resolve:-2", got
    assert not got[f"{net.b}:8080"].startswith("open"), got
    assert got[f"{net.c}:8080"] == f"open {net.c}", got
    # DNS to any other server gets nothing back; the resolver answers
    assert raw(sb, net.a, "allowed.test") == ["none"]
    assert raw(sb, backend.network.gateway, "allowed.test") == ["0"]
    # the log holds exactly what was asked, in order, with the decision and answer
    assert asked(backend, sb.id, before) == [
        ("allowed.test", "A", True, [net.a]),
        ("blocked.test", "A", False, []),
        ("x.wild.test", "A", True, [net.c]),
        ("wild.test", "A", False, []),
        ("allowed.test", "A", True, [net.a]),
    ]
    entry = backend.dns_log(sb.id)[-1]
    assert entry["generation"] == sb.spec.generation and entry["rcode"] == "NOERROR"


def test_an_address_is_dropped_after_its_ttl_and_the_grace(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    sb = make({"allow": ["short.test"]})
    assert lookup(sb, ["short.test:8080"]) == {"short.test:8080": f"open {net.c}"}
    assert f"{sb.endpoint.host} . {net.c}" in backend.network._elements("allow_dst")
    deadline = time.monotonic() + 1 + GRACE + 10
    while time.monotonic() < deadline:
        if f"{sb.endpoint.host} . {net.c}" not in backend.network._elements("allow_dst"):
            break
        time.sleep(0.2)  # polling the set for the expiry, with a deadline
    assert f"{sb.endpoint.host} . {net.c}" not in backend.network._elements("allow_dst")
    assert not probe(sb, [f"{net.c}:8080"])[f"{net.c}:8080"].startswith("open")


def test_floods_are_limited_and_tunnel_like_queries_flagged(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    sb = make({"allow": ["*.wild.test"]})
    gw = backend.network.gateway
    label = "a" * 60
    assert raw(sb, gw, f"{label}.wild.test", qtype=16) == ["0"]  # allowed, but flagged
    codes = raw(sb, gw, "y.wild.test", count=120)
    assert codes.count("5") > 0, codes  # REFUSED once the bucket is empty
    assert codes.count("0") >= 30, codes  # the burst is answered
    entries = backend.dns_log(sb.id)
    tunnel = [e for e in entries if e["name"] == f"{label}.wild.test"]
    assert tunnel and tunnel[0]["flags"] == ["tunnel_suspect"] and tunnel[0]["type"] == "TXT"
    limited = [e for e in entries if "rate_limited" in e["flags"]]
    assert len(limited) == codes.count("5")
    assert all(e["rcode"] == "REFUSED" and not e["allowed"] for e in limited)


def test_long_names_of_short_labels_are_flagged_oversized(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    """Tunnels split their data over many labels each under the long-label mark: the
    name's length is what gives them away."""
    sb = make({"allow": ["*.wild.test"]})
    gw = backend.network.gateway
    chunked = ".".join(["b" * 36] * 4) + ".wild.test"  # 157 characters, labels of 36
    assert raw(sb, gw, chunked) == ["0"]  # allowed: answered, but flagged
    assert raw(sb, gw, "z.wild.test") == ["0"]
    entries = {e["name"]: e for e in backend.dns_log(sb.id)}
    assert entries[chunked]["flags"] == ["oversized"], entries[chunked]
    assert entries[chunked]["allowed"] is True
    assert entries["z.wild.test"]["flags"] == [], entries["z.wild.test"]


def test_all_resolves_every_name_through_the_resolver_and_none_reaches_no_dns(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    opened = make("all")
    before = len(backend.dns_log(opened.id))
    got = lookup(opened, ["blocked.test:8080"])
    assert got == {"blocked.test:8080": f"open {net.b}"}
    assert asked(backend, opened.id, before) == [("blocked.test", "A", True, [net.b])]
    assert backend.network._elements("allow_dst") == [] or all(
        not e.startswith(f"{opened.endpoint.host} ") for e in backend.network._elements("allow_dst")
    )
    closed = make("none")
    assert raw(closed, backend.network.gateway, "allowed.test") == ["none"]
    assert lookup(closed, ["allowed.test:8080"])["allowed.test:8080"].startswith("resolve:")
    assert backend.dns_log(closed.id) == []


# Resolve <name> and send one UDP datagram (a QUIC client's first packet, for the
# filter) to its address on <port>: "echo" when the listener's answer comes back,
# "none" when nothing does.
UDP = (
    "import socket,sys\n"
    "name,port=sys.argv[1],int(sys.argv[2])\n"
    "addr=socket.getaddrinfo(name,port,socket.AF_INET,socket.SOCK_DGRAM)[0][4][0]\n"
    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.settimeout(2)\n"
    "try:\n"
    "    s.connect((addr,port)); s.send(b'quic initial?')\n"
    "    print('echo' if s.recv(100).startswith(b'hello') else 'other')\n"
    "except OSError:\n"
    "    print('none')\n"
)


def datagram(sb: Sandbox, name: str, port: int) -> str:
    r = sb.exec(["python3", "-c", UDP, name, str(port)], timeout=60)
    assert r["termination"]["exit_code"] == 0, r
    return str(r["stdout"]["head"]).strip()


@pytest.mark.parametrize("match", ["ip", "sni"])
def test_udp_such_as_quic_is_refused_to_an_allowlist_even_on_an_allowed_address(
    make: Callable[[Any], Sandbox], net: Internet, match: str
) -> None:
    """Only TCP is ever opened for an allowlist (docs/egress.md "Shared addresses"):
    the allowed name's address takes TCP 443, a UDP datagram to it (QUIC) gets
    nothing back; under "all" the same datagram is answered, so the refusal is the
    policy's, not the test network's."""
    allowed = make({"allow": ["allowed.test"], "match": match})
    assert lookup(allowed, ["allowed.test:443"]) == {"allowed.test:443": f"open {net.a}"}
    assert datagram(allowed, "allowed.test", 443) == "none"
    assert datagram(make("all"), "allowed.test", 443) == "echo"


# Resolve <name>, connect to its address on <port> and send a TLS ClientHello naming
# <server name> (443) or an HTTP request with that Host (80): prints "reached" when the
# listener's greeting comes back, "closed" when the connection is cut.
HELLO = (
    "import socket,ssl,sys\n"
    "name,port,sni=sys.argv[1],int(sys.argv[2]),sys.argv[3]\n"
    "addr=socket.getaddrinfo(name,port,socket.AF_INET,socket.SOCK_STREAM)[0][4][0]\n"
    "if port==443:\n"
    "    inc,out=ssl.MemoryBIO(),ssl.MemoryBIO()\n"
    "    tls=ssl.create_default_context().wrap_bio(inc,out,server_hostname=sni)\n"
    "    try:\n"
    "        tls.do_handshake()\n"
    "    except ssl.SSLWantReadError:\n"
    "        pass\n"
    "    first=out.read()\n"
    "else:\n"
    "    first=('GET / HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n' % sni).encode()\n"
    "s=socket.create_connection((addr,port),timeout=5)\n"
    "try:\n"
    "    s.sendall(first); data=s.recv(100)\n"
    "except OSError:\n"
    "    data=b''\n"
    "print('reached' if data.startswith(b'hello') else 'closed')\n"
)


def hello(sb: Sandbox, name: str, port: int, sni: str) -> str:
    r = sb.exec(["python3", "-c", HELLO, name, str(port), sni], timeout=60)
    assert r["termination"]["exit_code"] == 0, r
    return str(r["stdout"]["head"]).strip()


def test_match_sni_refuses_another_site_behind_an_allowed_address(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    sb = make({"allow": ["allowed.test"], "match": "sni"})
    before = len(backend.dns_log(sb.id))
    assert hello(sb, "allowed.test", 443, "allowed.test") == "reached"
    assert hello(sb, "allowed.test", 443, "other-cdn.test") == "closed"  # same address
    assert hello(sb, "allowed.test", 80, "allowed.test") == "reached"
    assert hello(sb, "allowed.test", 80, "other-cdn.test") == "closed"
    checks = [
        (e["type"], e["name"], e["allowed"])
        for e in backend.dns_log(sb.id)[before:]
        if e["type"] in ("SNI", "HOST")
    ]
    assert checks == [
        ("SNI", "allowed.test", True),
        ("SNI", "other-cdn.test", False),
        ("HOST", "allowed.test", True),
        ("HOST", "other-cdn.test", False),
    ]
    # without "match": "sni" the address is open to any site behind it (what it fixes)
    plain = make({"allow": ["allowed.test"]})
    assert hello(plain, "allowed.test", 443, "other-cdn.test") == "reached"


def test_answers_naming_denied_or_host_addresses_open_nothing(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    sb = make({"allow": ["evil.test", "hostaddr.test"], "match": "sni"})
    before = len(backend.dns_log(sb.id))
    got = lookup(sb, ["evil.test:80", "hostaddr.test:80", "evil.test:8080"])
    assert not any(v.startswith("open") for v in got.values()), got
    entries = backend.dns_log(sb.id)[before:]
    assert {e["name"] for e in entries} == {"evil.test", "hostaddr.test"}
    assert all("forbidden_answer" in e["flags"] and e["answer"] == [] for e in entries), entries
    assert not [e for e in backend.network._elements("allow_dst") if e.startswith(sb.endpoint.host)]


def test_the_watcher_restarts_a_killed_resolver_and_dns_works_again(
    make: Callable[[Any], Sandbox], backend: LocalBackend, net: Internet
) -> None:
    import signal

    from apps.sandboxes.backends.local import resolver

    sb = make({"allow": ["allowed.test"]})
    assert lookup(sb, ["allowed.test:8080"])["allowed.test:8080"] == f"open {net.a}"
    pid_file = backend.config.state_dir / "resolver.pid"
    old_pid = int(pid_file.read_text().split()[0])
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while resolver.pid_alive(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the kill to land, with a deadline
    assert not resolver.pid_alive(pid_file)
    # dead: the sandbox's lookups fail now (nothing answers on the gateway)
    assert raw(sb, backend.network.gateway, "allowed.test") == ["none"]
    restarts = backend.resolver_restarts
    deadline = time.monotonic() + 30
    while not resolver.pid_alive(pid_file):
        assert time.monotonic() < deadline, "the watcher did not restart the resolver"
        list(backend.watch(timeout_s=0.5))  # the watcher's passes
    assert backend.resolver_restarts == restarts + 1
    assert int(pid_file.read_text().split()[0]) != old_pid
    got = lookup(sb, ["allowed.test:8081", "blocked.test:8080"])
    assert got["allowed.test:8081"] == f"open {net.a}", got
    assert got["blocked.test:8080"] == "resolve:-2", got
