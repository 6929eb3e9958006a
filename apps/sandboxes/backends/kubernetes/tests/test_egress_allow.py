"""Egress allowlists on Kubernetes (egress_allow.py) against the FAKE API server: the
objects are right — the pod asks the installation's resolver only, its NetworkPolicy
allows DNS to it and the CIDR:port entries and nothing else, every resolution becomes a
/32 policy that expires, and destroy removes them all. That a CNI enforces them is what
only a real cluster shows (docs/egress.md "Kubernetes")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from apps.core.egress import parse_egress
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.config import sandbox_labels
from apps.sandboxes.backends.kubernetes.egress_allow import A_EXPIRES, A_NAME, AllowlistEgress

from .conftest import NS, new_spec
from .fakekube import FakeKube

RESOLVER = "10.96.0.53"


def _policies(fake: FakeKube) -> dict[str, Any]:
    return {name: obj for (r, _ns, name), obj in fake.objects.items() if r == "networkpolicies"}


def _allowlist_spec():
    return new_spec(
        network_access=True,
        egress=parse_egress({"allow": ["pkg.example.org", "192.0.2.0/24:443"]}),
    )


def test_an_allowlist_pod_asks_the_resolver_only_and_its_policy_opens_nothing_else(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    backend = make_backend(resolver_ip=RESOLVER)
    spec = _allowlist_spec()
    backend.provision(spec)
    pod = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
    assert pod["spec"]["dnsPolicy"] == "None"
    assert pod["spec"]["dnsConfig"]["nameservers"] == [RESOLVER]
    policy = _policies(fake)[f"hr-{spec.sandbox_id}-1-egress"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector["hedgerow.dev/sandbox"] == spec.sandbox_id
    assert selector["hedgerow.dev/generation"] == "1"
    rules = policy["spec"]["egress"]
    peers = [(p["ipBlock"]["cidr"], r.get("ports")) for r in rules for p in r["to"]]
    assert peers == [
        (f"{RESOLVER}/32", [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]),
        ("192.0.2.0/24", [{"protocol": "TCP", "port": 443}]),
    ]
    assert "0.0.0.0/0" not in str(policy)  # never the whole network
    backend.destroy(spec.sandbox_id)
    assert set(_policies(fake)) == {"hedgerow-t1-default"}


def test_without_the_resolver_an_allowlist_is_refused_and_nothing_is_created(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    with pytest.raises(BackendError, match="resolver"):
        backend.provision(_allowlist_spec())
    assert not [k for k in fake.objects if k[0] in ("pods", "secrets")]
    assert set(_policies(fake)) == {"hedgerow-t1-default"}


def test_resolutions_open_their_addresses_until_they_expire(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    backend = make_backend(resolver_ip=RESOLVER)
    spec = _allowlist_spec()
    backend.provision(spec)
    egress = AllowlistEgress(backend.api, backend.policies, backend.config)
    labels = sandbox_labels(
        backend.config, tenant_id=spec.tenant_id, sandbox_id=spec.sandbox_id, generation=1
    )
    made = egress.resolved(
        labels=labels,
        sandbox_id=spec.sandbox_id,
        generation=1,
        name="pkg.example.org",
        answers=[("203.0.113.7", 60), ("169.254.169.254", 60), ("127.0.0.1", 60)],
        grace_s=30,
        now=1000.0,
    )
    assert len(made) == 1  # link-local and loopback answers open nothing
    opened = _policies(fake)[made[0]]
    assert opened["metadata"]["annotations"] == {A_EXPIRES: "1090", A_NAME: "pkg.example.org"}
    (rule,) = opened["spec"]["egress"]
    assert rule["to"] == [{"ipBlock": {"cidr": "203.0.113.7/32"}}]
    assert rule["ports"] == [{"protocol": "TCP"}]
    assert opened["spec"]["podSelector"]["matchLabels"]["hedgerow.dev/sandbox"] == spec.sandbox_id
    # the same answer again in the same second: one object, no error
    assert (
        egress.resolved(
            labels=labels,
            sandbox_id=spec.sandbox_id,
            generation=1,
            name="pkg.example.org",
            answers=[("203.0.113.7", 60)],
            grace_s=30,
            now=1000.0,
        )
        == made
    )
    later = egress.resolved(
        labels=labels,
        sandbox_id=spec.sandbox_id,
        generation=1,
        name="pkg.example.org",
        answers=[("203.0.113.8", 600)],
        grace_s=30,
        now=1000.0,
    )
    assert egress.sweep(now=1089.0) == []
    assert egress.sweep(now=1090.0) == made  # expired; the longer one stays
    assert set(later) <= set(_policies(fake))
    assert made[0] not in _policies(fake)
    # destroy removes every resolution with the sandbox's other objects
    backend.destroy(spec.sandbox_id)
    assert set(_policies(fake)) == {"hedgerow-t1-default"}
