"""The in-cluster resolver (kubernetes/resolver.py) against the FAKE API server, a real
Redis and a real upstream DNS server on loopback: the local backend's filtering
resolver, finding the asking pod by its address, reading its policy from the
annotation the control plane writes, opening /32 policies for what it hands out and
logging every query where ``dns_log`` (the query-log API) reads it. Queries are
handed to the resolver with the pod's address as their source (a pod's address
cannot be had on this machine); that the CNI enforces the policies, and that pod
traffic really arrives from the pod's address, needs a real cluster
(docs/egress.md "Kubernetes")."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import dns.message
import dns.rcode
import dns.rrset
import pytest
import redis
from django.conf import settings

from apps.core.egress import parse_egress
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.egress_allow import A_NAME, AllowlistEgress
from apps.sandboxes.backends.kubernetes.permissions import REQUIRED
from apps.sandboxes.backends.kubernetes.resolver import ClusterResolver, PodDirectory

from .conftest import NS, new_spec
from .fakekube import FakeKube

RESOLVER = "10.96.0.53"
ZONE = {
    "pkg.example.org": "203.0.113.7",
    "git.example.org": "203.0.113.8",
    "blocked.example.org": "203.0.113.9",
    "internal.example.org": "10.96.0.1",  # a cluster address behind a public name
}


@pytest.fixture
def upstream() -> Iterator[tuple[str, int]]:
    """An authoritative server for ZONE on 127.0.0.1 (UDP), answering with TTL 300."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    asked: list[str] = []

    def serve() -> None:
        while True:
            try:
                wire, peer = sock.recvfrom(4096)
            except OSError:
                return
            query = dns.message.from_wire(wire)
            reply = dns.message.make_response(query)
            name = query.question[0].name.to_text(omit_final_dot=True)
            asked.append(name)
            if name in ZONE:
                reply.answer.append(dns.rrset.from_text(name + ".", 300, "IN", "A", ZONE[name]))
            else:
                reply.set_rcode(dns.rcode.NXDOMAIN)
            sock.sendto(reply.to_wire(), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()
    sock.close()
    thread.join(5)


@pytest.fixture
def redis_conn() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def _ask(resolver: ClusterResolver, source: str, name: str) -> dns.message.Message:
    wire = dns.message.make_query(name, "A").to_wire()
    reply = asyncio.run(resolver.handle(wire, source))
    assert reply is not None
    return dns.message.from_wire(reply)


def _resolved(fake: FakeKube, sandbox_id: str) -> dict[str, str]:
    """The sandbox's /32 policies: address → the name it was handed out for."""
    return {
        obj["spec"]["egress"][0]["to"][0]["ipBlock"]["cidr"]: obj["metadata"]["annotations"][A_NAME]
        for (r, _ns, _n), obj in fake.objects.items()
        if r == "networkpolicies"
        and obj["metadata"]["labels"].get("hedgerow.dev/egress") == "resolved"
        and obj["metadata"]["labels"]["hedgerow.dev/sandbox"] == sandbox_id
    }


def test_the_in_cluster_resolver_answers_opens_and_logs_by_the_asking_pod(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    upstream: tuple[str, int],
    redis_conn: Any,
) -> None:
    fake.auto_start = True
    worker = make_backend(resolver_ip=RESOLVER)
    spec = new_spec(
        network_access=True,
        egress=parse_egress({"allow": ["pkg.example.org", "*.example.org"]}),
    )
    other = new_spec(network_access=False)
    worker.provision(spec)
    worker.provision(other)
    ip = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]["status"]["podIP"]
    other_ip = fake.objects[("pods", NS, f"hr-{other.sandbox_id}-1")]["status"]["podIP"]
    # the resolver runs as its own ServiceAccount: the fake refuses what its Role lacks
    as_resolver = make_backend("hedgerow-resolver", resolver_ip=RESOLVER)
    resolver = ClusterResolver(
        PodDirectory(as_resolver.api, as_resolver.policies, as_resolver.config, cache_s=0),
        upstream,
        AllowlistEgress(as_resolver.api, as_resolver.policies, as_resolver.config),
        redis_conn,
    )
    try:
        answer = _ask(resolver, ip, "pkg.example.org")
        assert answer.rcode() == dns.rcode.NOERROR
        assert [rd.address for rrset in answer.answer for rd in rrset] == ["203.0.113.7"]
        # the address was open before the answer left
        assert _resolved(fake, spec.sandbox_id) == {"203.0.113.7/32": "pkg.example.org"}

        assert _ask(resolver, ip, "elsewhere.test").rcode() == dns.rcode.NXDOMAIN
        # a cluster address behind an allowed name is answered but opens nothing
        assert _ask(resolver, ip, "internal.example.org").rcode() == dns.rcode.NOERROR
        assert set(_resolved(fake, spec.sandbox_id)) == {"203.0.113.7/32"}
        # a "none" sandbox and an address no sandbox has: REFUSED, nothing logged
        assert _ask(resolver, other_ip, "pkg.example.org").rcode() == dns.rcode.REFUSED
        assert _ask(resolver, "10.42.9.9", "pkg.example.org").rcode() == dns.rcode.REFUSED

        # a live change (PATCH): the next query follows it, the dropped name's
        # address is closed
        assert _ask(resolver, ip, "git.example.org").rcode() == dns.rcode.NOERROR
        assert "203.0.113.8/32" in _resolved(fake, spec.sandbox_id)
        worker.set_egress(spec.sandbox_id, parse_egress({"allow": ["pkg.example.org"]}))
        assert _resolved(fake, spec.sandbox_id) == {"203.0.113.7/32": "pkg.example.org"}
        assert _ask(resolver, ip, "git.example.org").rcode() == dns.rcode.NXDOMAIN

        log = worker.dns_log(spec.sandbox_id)
        assert [(e["name"], e["allowed"], e["rcode"], e["generation"]) for e in log] == [
            ("pkg.example.org", True, "NOERROR", 1),
            ("elsewhere.test", False, "NXDOMAIN", 1),
            ("internal.example.org", True, "NOERROR", 1),
            ("git.example.org", True, "NOERROR", 1),
            ("git.example.org", False, "NXDOMAIN", 1),
        ]
        assert log[0]["answer"] == [{"address": "203.0.113.7", "ttl": 300}]
        assert worker.dns_log(other.sandbox_id) == []

        # a pod that ended keeps its address in its status: it speaks for it no more
        fake.set_pod_status(NS, f"hr-{spec.sandbox_id}-1", phase="Failed", pod_ip=ip)
        assert _ask(resolver, ip, "pkg.example.org").rcode() == dns.rcode.REFUSED
        fake.set_pod_status(NS, f"hr-{spec.sandbox_id}-1", phase="Running", pod_ip=ip, running=True)

        # expiry: the sweep closes what outlived TTL + grace, destroy the rest
        egress = AllowlistEgress(as_resolver.api, as_resolver.policies, as_resolver.config)
        assert egress.sweep() == []
        assert len(egress.sweep(now=4_000_000_000.0)) == 1
        assert _resolved(fake, spec.sandbox_id) == {}
        _ask(resolver, ip, "pkg.example.org")
        worker.destroy(spec.sandbox_id)
        assert _resolved(fake, spec.sandbox_id) == {}
        # the pod is gone: its address asks nothing any more
        assert _ask(resolver, ip, "pkg.example.org").rcode() == dns.rcode.REFUSED
    finally:
        redis_conn.delete(f"hedgerow:t1:dns:{spec.sandbox_id}")


def test_queries_over_the_rate_are_refused_and_flagged_as_on_the_local_backend(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    upstream: tuple[str, int],
    redis_conn: Any,
) -> None:
    fake.auto_start = True
    worker = make_backend(resolver_ip=RESOLVER)
    spec = new_spec(network_access=True, egress=parse_egress({"allow": ["pkg.example.org"]}))
    worker.provision(spec)
    ip = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]["status"]["podIP"]
    as_resolver = make_backend("hedgerow-resolver", resolver_ip=RESOLVER)
    resolver = ClusterResolver(
        PodDirectory(as_resolver.api, as_resolver.policies, as_resolver.config, cache_s=60),
        upstream,
        AllowlistEgress(as_resolver.api, as_resolver.policies, as_resolver.config),
        redis_conn,
    )
    try:
        # 200 at once: the bucket holds 40 and refills 20 a second, so some are refused
        # unless asking took longer than 8 s
        rcodes = [_ask(resolver, ip, "x" * 50 + ".tunnel.test").rcode() for _ in range(200)]
        assert dns.rcode.REFUSED in rcodes
        log = worker.dns_log(spec.sandbox_id)
        assert len(log) == 200
        assert all("tunnel_suspect" in e["flags"] for e in log)
        assert any("rate_limited" in e["flags"] for e in log)
    finally:
        redis_conn.delete(f"hedgerow:t1:dns:{spec.sandbox_id}")


def test_the_resolver_is_granted_exactly_what_it_calls(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    upstream: tuple[str, int],
    redis_conn: Any,
) -> None:
    from .test_manifests import build
    from .test_rbac import granted, walk

    fake.auto_start = True
    worker = make_backend(resolver_ip=RESOLVER)
    spec = new_spec(network_access=True, egress=parse_egress({"allow": ["pkg.example.org"]}))
    worker.provision(spec)
    ip = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]["status"]["podIP"]
    as_resolver = make_backend("hedgerow-resolver", resolver_ip=RESOLVER)
    egress = AllowlistEgress(as_resolver.api, as_resolver.policies, as_resolver.config)
    resolver = ClusterResolver(
        PodDirectory(as_resolver.api, as_resolver.policies, as_resolver.config, cache_s=0),
        upstream,
        egress,
        redis_conn,
    )
    try:
        used = walk(fake, lambda: _ask(resolver, ip, "pkg.example.org"))
        used |= walk(fake, lambda: egress.sweep(now=4_000_000_000.0))
    finally:
        redis_conn.delete(f"hedgerow:t1:dns:{spec.sandbox_id}")
    assert used == granted(build("deploy/overlays/example"), "hedgerow-resolver")
    assert used == REQUIRED["resolver"]  # what it asks for at start-up
