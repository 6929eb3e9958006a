"""Egress allowlists on Kubernetes (egress_allow.py) against the FAKE API server: the
objects are right — the pod asks the installation's resolver only, its NetworkPolicy
allows DNS to it and the CIDR:port entries and nothing else, every resolution becomes a
/32 policy that expires, and destroy removes them all. That a CNI enforces them is what
only a real cluster shows (docs/egress.md "Kubernetes")."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from apps.core.egress import parse_egress
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.config import sandbox_labels
from apps.sandboxes.backends.kubernetes.egress_allow import (
    A_EXPIRES,
    A_NAME,
    A_POLICY,
    AllowlistEgress,
)
from apps.sandboxes.backends.kubernetes.permissions import CILIUM_WORKER, REQUIRED

from .conftest import NS, new_spec
from .fakekube import FakeKube

RESOLVER = "10.96.0.53"
# DNS to the resolver only: its Service address on 53 (CNIs matching before the DNAT)
# and its pods on their own port (those matching after it)
RESOLVER_RULE = {
    "to": [
        {"ipBlock": {"cidr": f"{RESOLVER}/32"}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "hedgerow"}},
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "hedgerow",
                    "app.kubernetes.io/component": "resolver",
                }
            },
        },
    ],
    "ports": [
        {"protocol": "UDP", "port": 53},
        {"protocol": "TCP", "port": 53},
        {"protocol": "UDP", "port": 5353},
        {"protocol": "TCP", "port": 5353},
    ],
}


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
    dns_rule, cidr_rule = policy["spec"]["egress"]
    assert dns_rule == RESOLVER_RULE
    assert cidr_rule == {
        "to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    }
    assert "0.0.0.0/0" not in str(policy)  # never the whole network
    # the policy the in-cluster resolver reads for this pod
    assert json.loads(policy["metadata"]["annotations"][A_POLICY]) == {
        "allow": ["pkg.example.org", "192.0.2.0/24:443"],
        "dns": "filtered",
    }
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


def _resolve(
    backend: KubernetesBackend, spec: Any, name: str, answers: list[tuple[str, int]]
) -> list[str]:
    labels = sandbox_labels(
        backend.config, tenant_id=spec.tenant_id, sandbox_id=spec.sandbox_id, generation=1
    )
    return AllowlistEgress(backend.api, backend.policies, backend.config).resolved(
        labels=labels,
        sandbox_id=spec.sandbox_id,
        generation=1,
        name=name,
        answers=answers,
        grace_s=30,
        policy=spec.egress_policy,
    )


def test_with_the_resolver_none_and_all_pods_ask_it_too_and_all_keeps_its_ranges_denied(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    backend = make_backend(resolver_ip=RESOLVER)
    none = new_spec(network_access=False)
    everything = new_spec(network_access=True, egress=parse_egress("all"))
    backend.provision(none)
    backend.provision(everything)
    for spec in (none, everything):  # a pod's DNS is fixed: every pod gets the resolver
        pod = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
        assert pod["spec"]["dnsPolicy"] == "None"
        assert pod["spec"]["dnsConfig"]["nameservers"] == [RESOLVER]
    policies = _policies(fake)
    assert f"hr-{none.sandbox_id}-1-egress" not in policies  # "none": the namespace's deny
    full = policies[f"hr-{everything.sandbox_id}-1-egress"]
    world, cluster_dns, resolver = full["spec"]["egress"]
    assert world["to"][0]["ipBlock"]["cidr"] == "0.0.0.0/0"
    assert {"10.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12"} <= set(
        world["to"][0]["ipBlock"]["except"]
    )
    assert resolver == RESOLVER_RULE
    assert json.loads(full["metadata"]["annotations"][A_POLICY]) == "all"


def test_cluster_internal_answers_open_nothing_unless_a_listed_cidr_holds_them(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    backend = make_backend(resolver_ip=RESOLVER)
    spec = new_spec(
        network_access=True,
        egress=parse_egress({"allow": ["pkg.example.org", "10.20.0.0/16:443"]}),
    )
    backend.provision(spec)
    made = _resolve(
        backend,
        spec,
        "pkg.example.org",
        [("10.96.0.1", 60), ("172.16.3.4", 60), ("10.20.1.2", 60), ("198.51.100.9", 60)],
    )
    cidrs = sorted(
        _policies(fake)[m]["spec"]["egress"][0]["to"][0]["ipBlock"]["cidr"] for m in made
    )
    # the API server's ClusterIP and another private range: nothing; the listed one and
    # a public address: opened
    assert cidrs == ["10.20.1.2/32", "198.51.100.9/32"]


def test_a_live_change_replaces_the_objects_and_closes_what_the_new_policy_drops(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    backend = make_backend(resolver_ip=RESOLVER)
    spec = new_spec(
        network_access=True,
        egress=parse_egress({"allow": ["pkg.example.org", "git.example.org"]}),
    )
    backend.provision(spec)
    name = f"hr-{spec.sandbox_id}-1-egress"
    pkg = _resolve(backend, spec, "pkg.example.org", [("203.0.113.7", 600)])
    git = _resolve(backend, spec, "git.example.org", [("203.0.113.8", 600)])
    uid = _policies(fake)[name]["metadata"]["uid"]

    # narrowed: git's address closes at once, pkg's stays; the annotation follows
    backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["pkg.example.org"]}))
    policies = _policies(fake)
    assert set(pkg) <= set(policies) and not set(git) & set(policies)
    assert json.loads(policies[name]["metadata"]["annotations"][A_POLICY]) == {
        "allow": ["pkg.example.org"],
        "dns": "filtered",
    }
    assert policies[name]["metadata"]["uid"] == uid  # replaced in place, never absent
    assert policies[name]["metadata"]["ownerReferences"][0]["kind"] == "Pod"

    # "all": the whole network (minus the denied ranges), resolutions no longer needed
    backend.set_egress(spec.sandbox_id, parse_egress("all"))
    policies = _policies(fake)
    assert not set(pkg) & set(policies)
    assert policies[name]["spec"]["egress"][0]["to"][0]["ipBlock"]["cidr"] == "0.0.0.0/0"
    assert json.loads(policies[name]["metadata"]["annotations"][A_POLICY]) == "all"

    # back to an allowlist: no 0.0.0.0/0 left anywhere
    backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["192.0.2.0/24:443"]}))
    assert "0.0.0.0/0" not in str(_policies(fake)[name])

    # "none": the sandbox's own policy goes, the namespace's deny is all that is left
    backend.set_egress(spec.sandbox_id, parse_egress("none"))
    assert set(_policies(fake)) == {"hedgerow-t1-default"}
    backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["pkg.example.org"]}))
    assert name in _policies(fake)
    backend.destroy(spec.sandbox_id)
    assert set(_policies(fake)) == {"hedgerow-t1-default"}


def test_what_kubernetes_cannot_enforce_is_refused_and_changes_nothing(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    # a pod created before the installation had a resolver keeps the cluster's DNS:
    # it cannot take an allowlist later (a pod's DNS is fixed)
    before = make_backend()
    spec = new_spec(network_access=True, egress=parse_egress("all"))
    before.provision(spec)
    snapshot = {k: json.dumps(v, sort_keys=True) for k, v in fake.objects.items()}
    backend = make_backend(resolver_ip=RESOLVER)
    with pytest.raises(BackendError, match="nameserver"):
        backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["pkg.example.org"]}))
    # SNI matching: NetworkPolicies see addresses only
    sni = parse_egress({"allow": ["pkg.example.org"], "match": "sni"})
    with pytest.raises(BackendError, match="sni"):
        backend.set_egress(spec.sandbox_id, sni)
    with pytest.raises(BackendError, match="sni"):
        backend.provision(new_spec(network_access=True, egress=sni))
    assert {k: json.dumps(v, sort_keys=True) for k, v in fake.objects.items()} == snapshot
    with pytest.raises(BackendError, match="no pod"):
        backend.set_egress("f" * 32, parse_egress("all"))


# The CiliumNetworkPolicy fields the backend writes, as Cilium's CRD (cilium.io/v2)
# defines them. The CRD's schema is not available offline here: this is a structural
# check of what we render, not Cilium's own validation (a real cluster's is).
_FQDN = re.compile(r"^[-a-zA-Z0-9_*.]+$")
_CILIUM_PROTOCOLS = {"TCP", "UDP", "SCTP", "ANY"}


def cilium_errors(doc: dict[str, Any]) -> list[str]:
    errors: list[str] = []

    def keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
        errors.extend(f"{where}.{k}: not a field" for k in set(obj) - allowed)

    def selector(sel: dict[str, Any], where: str) -> None:
        keys(sel, {"matchLabels", "matchExpressions"}, where)
        labels = sel.get("matchLabels", {})
        errors.extend(f"{where}: {k}" for k, v in labels.items() if not isinstance(v, str))

    def fqdn(sel: dict[str, Any], where: str) -> None:
        keys(sel, {"matchName", "matchPattern"}, where)
        if len(sel) != 1 or not _FQDN.match(next(iter(sel.values()), "")):
            errors.append(f"{where}: one matchName or matchPattern of name characters")

    keys(doc, {"apiVersion", "kind", "metadata", "spec"}, "")
    if doc.get("apiVersion") != "cilium.io/v2" or doc.get("kind") != "CiliumNetworkPolicy":
        errors.append("apiVersion/kind")
    spec = doc.get("spec", {})
    keys(spec, {"endpointSelector", "egress", "ingress", "egressDeny", "ingressDeny"}, "spec")
    selector(spec.get("endpointSelector", {}), "spec.endpointSelector")
    for i, rule in enumerate(spec.get("egress", [])):
        where = f"spec.egress[{i}]"
        keys(rule, {"toEndpoints", "toPorts", "toFQDNs", "toCIDR", "toCIDRSet"}, where)
        for j, sel in enumerate(rule.get("toEndpoints", [])):
            selector(sel, f"{where}.toEndpoints[{j}]")
        for j, sel in enumerate(rule.get("toFQDNs", [])):
            fqdn(sel, f"{where}.toFQDNs[{j}]")
        for j, port_rule in enumerate(rule.get("toPorts", [])):
            at = f"{where}.toPorts[{j}]"
            keys(port_rule, {"ports", "rules"}, at)
            for k, port in enumerate(port_rule.get("ports", [])):
                keys(port, {"port", "protocol", "endPort"}, f"{at}.ports[{k}]")
                if not (isinstance(port.get("port"), str) and port["port"].isdigit()):
                    errors.append(f"{at}.ports[{k}].port: a string of digits")
                elif int(port["port"]) > 65535:
                    errors.append(f"{at}.ports[{k}].port: out of range")
                if port.get("protocol") not in _CILIUM_PROTOCOLS:
                    errors.append(f"{at}.ports[{k}].protocol")
            rules = port_rule.get("rules", {})
            keys(rules, {"dns", "http", "kafka", "l7proto", "l7"}, f"{at}.rules")
            for k, sel in enumerate(rules.get("dns", [])):
                fqdn(sel, f"{at}.rules.dns[{k}]")
    return errors


def test_the_structural_check_catches_what_cilium_would_refuse() -> None:
    bad = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {},
        "spec": {
            "endpointSelector": {"matchLabels": {"a": "b"}},
            "egress": [
                {"toFQDN": [{"matchName": "a.b"}]},  # typo
                {"toPorts": [{"ports": [{"port": 53, "protocol": "DNS"}]}]},
                {"toFQDNs": [{"matchName": "a.b", "matchPattern": "*.b"}]},
            ],
        },
    }
    assert len(cilium_errors(bad)) == 4


def test_with_cilium_an_allowlist_also_gets_fqdn_rules_that_follow_changes_and_go_with_it(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    from .test_manifests import build
    from .test_rbac import granted

    fake.auto_start = True
    # the worker as deploy/overlays/cilium grants it (the fake refuses anything else)
    cilium_worker = granted(build("deploy/overlays/cilium"), "hedgerow-worker")
    assert cilium_worker == REQUIRED["worker"] | CILIUM_WORKER
    fake.grants["hedgerow-worker"] = set(cilium_worker)
    backend = make_backend(resolver_ip=RESOLVER, cni="cilium")
    spec = new_spec(
        network_access=True,
        egress=parse_egress(
            {"allow": ["pkg.example.org", "*.git.example.org", "192.0.2.0/24:443"]}
        ),
    )
    backend.provision(spec)
    fqdn_name = f"hr-{spec.sandbox_id}-1-fqdn"
    cnp = fake.objects[("ciliumnetworkpolicies", NS, fqdn_name)]
    assert cilium_errors(cnp) == []
    assert cnp["spec"]["endpointSelector"]["matchLabels"] == {
        "hedgerow.dev/instance": "t1",
        "hedgerow.dev/sandbox": spec.sandbox_id,
        "hedgerow.dev/generation": "1",
    }
    dns_rule, fqdn_rule = cnp["spec"]["egress"]
    # DNS to the resolver's pods through Cilium's DNS proxy, for the allowed names only
    assert dns_rule["toEndpoints"] == [
        {
            "matchLabels": {
                "k8s:io.kubernetes.pod.namespace": "hedgerow",
                "k8s:app.kubernetes.io/name": "hedgerow",
                "k8s:app.kubernetes.io/component": "resolver",
            }
        }
    ]
    names = [{"matchName": "pkg.example.org"}, {"matchPattern": "*.git.example.org"}]
    assert dns_rule["toPorts"][0]["rules"] == {"dns": names}
    assert fqdn_rule == {
        "toFQDNs": names,
        "toPorts": [{"ports": [{"port": "0", "protocol": "TCP"}]}],  # TCP only: no QUIC
    }
    assert cnp["metadata"]["ownerReferences"][0]["kind"] == "Pod"
    # the NetworkPolicy is there too (DNS, CIDR:port entries, the policy annotation)
    assert f"hr-{spec.sandbox_id}-1-egress" in _policies(fake)
    # the resolver opens no /32 policies under Cilium: toFQDNs learns the answers
    from apps.sandboxes.backends.kubernetes.resolver import ClusterResolver, PodDirectory

    resolver = ClusterResolver(
        PodDirectory(backend.api, backend.policies, backend.config),
        ("127.0.0.1", 9),
        AllowlistEgress(backend.api, backend.policies, backend.config),
        redis=None,
    )
    client = PodDirectory(backend.api, backend.policies, backend.config).lookup(
        fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]["status"]["podIP"]
    )
    assert client is not None and client.policy == spec.egress_policy
    before = set(_policies(fake))
    resolver.open_addresses(client, "", "pkg.example.org", [("203.0.113.7", 60)])
    assert set(_policies(fake)) == before

    # a live change rewrites it; "all" removes it; an allowlist brings it back
    backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["pkg.example.org"]}))
    cnp = fake.objects[("ciliumnetworkpolicies", NS, fqdn_name)]
    assert cnp["spec"]["egress"][1]["toFQDNs"] == [{"matchName": "pkg.example.org"}]
    backend.set_egress(spec.sandbox_id, parse_egress("all"))
    assert ("ciliumnetworkpolicies", NS, fqdn_name) not in fake.objects
    backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["a.example.org"]}))
    assert cilium_errors(fake.objects[("ciliumnetworkpolicies", NS, fqdn_name)]) == []
    # the audit sees it as the sandbox's; destroy deletes it
    (item,) = [i for i in backend.inventory() if i.kind == "cilium_network_policy"]
    assert (item.name, item.sandbox_id) == (fqdn_name, spec.sandbox_id)
    backend.reclaim(item)  # what the audit does with one whose sandbox is gone
    assert ("ciliumnetworkpolicies", NS, fqdn_name) not in fake.objects
    backend.set_egress(spec.sandbox_id, parse_egress({"allow": ["a.example.org"]}))
    backend.destroy(spec.sandbox_id)
    assert not [k for k in fake.objects if k[0] == "ciliumnetworkpolicies"]
