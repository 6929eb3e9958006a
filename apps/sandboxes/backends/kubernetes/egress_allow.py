"""Egress allowlists on Kubernetes (issue 21; design in docs/egress.md "Kubernetes").

The same contract as the local backend, in Kubernetes objects only (no CNI-specific
FQDN policy needed):

* the sandbox's pod names the installation's resolver as its only nameserver
  (``dnsPolicy: None``, ``dnsConfig.nameservers = [resolver_ip]``): the resolver
  (``resolver.py``'s policy and log, run as an in-cluster Service) answers only the
  names the sandbox's policy permits;
* a base NetworkPolicy per sandbox generation allows only DNS to the resolver's address
  and the policy's ``CIDR:port`` entries (NetworkPolicies are additive: the namespace's
  default-deny covers the rest);
* every address the resolver hands out for an allowed name becomes one more
  NetworkPolicy, ``ipBlock: <address>/32`` on TCP, labelled as the sandbox's and
  annotated with its expiry (TTL + grace): ``resolved()`` creates it, ``sweep()``
  deletes the expired ones, and destroying the sandbox deletes them all with its other
  objects (same labels).

Only create/list/delete are used (one object per resolution, never a read-modify-write
of a shared policy), so concurrent resolutions cannot lose each other's addresses.
What a fake API server cannot show — that the CNI enforces these policies, and how long
it takes to program one after the resolver answered — is in docs/egress.md.
"""

from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from apps.core.egress import FORBIDDEN_NETWORKS, EgressPolicy
from apps.sandboxes.backends.base import BackendError

from .config import (
    L_GENERATION,
    L_INSTANCE,
    L_SANDBOX,
    KubernetesConfig,
    object_name,
    sandbox_labels,
)

L_EGRESS = "hedgerow.dev/egress"  # "allowlist" (the base policy) or "resolved"
A_EXPIRES = "hedgerow.dev/expires-at"  # unix seconds, on a resolved policy
A_NAME = "hedgerow.dev/resolved-name"  # the allowed name the address was handed out for
# the sandbox's policy (its JSON), on its base ``-egress`` object: what the in-cluster
# resolver reads for the pod that asks (resolver.py here); no such object = "none"
A_POLICY = "hedgerow.dev/egress-policy"
# the in-cluster resolver's pods (deploy/base/resolver.yaml)
RESOLVER_POD_LABELS = {
    "app.kubernetes.io/name": "hedgerow",
    "app.kubernetes.io/component": "resolver",
}
CILIUM_GROUP, CILIUM_VERSION, CILIUM_PLURAL = "cilium.io", "v2", "ciliumnetworkpolicies"


def _selector(config: KubernetesConfig, sandbox_id: str, generation: int) -> Any:
    return client.V1LabelSelector(
        match_labels={
            L_INSTANCE: config.instance,
            L_SANDBOX: sandbox_id,
            L_GENERATION: str(generation),
        }
    )


def allowlist_dns(resolver_ip: str) -> tuple[str, Any]:
    """(dnsPolicy, dnsConfig) of a sandbox's pod when the installation runs the
    resolver: the resolver only (a pod's DNS cannot change once it exists, so every
    pod gets it, and a live change to an allowlist keeps working)."""
    return "None", client.V1PodDNSConfig(
        nameservers=[resolver_ip],
        searches=[],
        options=[client.V1PodDNSConfigOption(name="ndots", value="1")],
    )


def resolver_rule(config: KubernetesConfig) -> Any:
    """DNS to the resolver and nowhere else: its Service address on 53 (CNIs that
    match before the Service's DNAT) and its pods on ``resolver_port`` (those that
    match after it, most of them)."""
    return client.V1NetworkPolicyEgressRule(
        to=[
            client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=f"{config.resolver_ip}/32")),
            client.V1NetworkPolicyPeer(
                namespace_selector=client.V1LabelSelector(
                    match_labels={"kubernetes.io/metadata.name": config.controlplane_namespace}
                ),
                pod_selector=client.V1LabelSelector(match_labels=dict(RESOLVER_POD_LABELS)),
            ),
        ],
        ports=[
            client.V1NetworkPolicyPort(protocol=proto, port=port)
            for port in (53, config.resolver_port)
            for proto in ("UDP", "TCP")
        ],
    )


def _excepted(network: ipaddress.IPv4Network) -> list[str] | None:
    """The always-denied ranges inside a listed CIDR (the grammar refuses overlaps;
    kept here so a policy stored before a range was added still cannot reach it)."""
    inside = [str(n) for n in FORBIDDEN_NETWORKS if n != network and n.subnet_of(network)]
    return inside or None


def build_allowlist_policy(
    config: KubernetesConfig,
    meta: Any,
    sandbox_id: str,
    generation: int,
    policy: EgressPolicy,
    resolver_ip: str = "",
) -> Any:
    """The base policy of an allowlist sandbox: DNS to the resolver, and the CIDR:port
    entries. ``meta``: the sandbox's object metadata (specs._meta), suffix ``-egress``."""
    meta.labels = {**(meta.labels or {}), L_EGRESS: "allowlist"}
    meta.annotations = {**(meta.annotations or {}), A_POLICY: policy_json(policy)}
    rules = [resolver_rule(config)]
    for rule in policy.cidrs:
        rules.append(
            client.V1NetworkPolicyEgressRule(
                to=[
                    client.V1NetworkPolicyPeer(
                        ip_block=client.V1IPBlock(
                            cidr=str(rule.network), _except=_excepted(rule.network)
                        )
                    )
                ],
                ports=[client.V1NetworkPolicyPort(protocol="TCP", port=rule.port)],
            )
        )
    return client.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=meta,
        spec=client.V1NetworkPolicySpec(
            pod_selector=_selector(config, sandbox_id, generation),
            policy_types=["Egress"],
            egress=rules,
        ),
    )


def policy_json(policy: EgressPolicy) -> str:
    return json.dumps(policy.to_json(), separators=(",", ":"), sort_keys=True)


def check_supported(config: KubernetesConfig, policy: EgressPolicy) -> None:
    """What a Kubernetes installation cannot enforce is refused, never widened:

    * an allowlist without the in-cluster resolver (``resolver_ip``);
    * ``"match": "sni"``: a NetworkPolicy sees addresses and ports only, and the
      backend renders no L7 (SNI) policy of any CNI (docs/egress.md "Kubernetes")."""
    if policy.mode != "allow":
        return
    if not config.resolver_ip:
        raise BackendError(
            "egress allowlists on kubernetes need the in-cluster resolver (resolver_ip)"
        )
    if policy.match == "sni":
        raise BackendError(
            'egress "match": "sni" is not enforced on kubernetes (NetworkPolicies see '
            "addresses only): give the allowlist without it"
        )


@dataclass(frozen=True)
class Target:
    """What the egress objects are built from: a SandboxSpec's fields, or a running
    pod's labels (``set_egress``)."""

    sandbox_id: str
    tenant_id: str
    generation: int
    egress_policy: EgressPolicy


def _meta(config: KubernetesConfig, spec: Any, suffix: str) -> Any:
    return client.V1ObjectMeta(
        name=object_name(spec.sandbox_id, spec.generation, suffix),
        namespace=config.namespace,
        labels=sandbox_labels(
            config, tenant_id=spec.tenant_id, sandbox_id=spec.sandbox_id, generation=spec.generation
        ),
    )


def egress_policy_for(config: KubernetesConfig, spec: Any) -> Any:
    """The sandbox's own egress NetworkPolicy: an allowlist's base policy; for "all"
    with a resolver, specs' "all" policy plus DNS to the resolver and the policy
    annotation (the resolver forwards any name for it); None otherwise (the caller
    builds the "all" policy, or none for "none")."""
    from .specs import build_egress_policy

    policy: EgressPolicy = spec.egress_policy
    if policy.mode == "allow":
        return build_allowlist_policy(
            config, _meta(config, spec, "-egress"), spec.sandbox_id, spec.generation, policy
        )
    if policy.mode == "all" and config.resolver_ip:
        body = build_egress_policy(config, spec)
        body.spec.egress.append(resolver_rule(config))
        body.metadata.annotations = {
            **(body.metadata.annotations or {}),
            A_POLICY: policy_json(policy),
        }
        return body
    return None


def fqdn_selector(pattern: str) -> dict[str, str]:
    """A policy name as Cilium's FQDN selector: ``*.b.c`` a pattern, a name an exact
    match. Cilium's ``*`` matches within one label, so there a wildcard reaches one
    level below its suffix only: narrower than the resolver, never wider
    (docs/egress.md "Kubernetes")."""
    if pattern.startswith("*."):
        return {"matchPattern": pattern}
    return {"matchName": pattern}


def build_cilium_policy(config: KubernetesConfig, spec: Any) -> dict[str, Any] | None:
    """An allowlist's CiliumNetworkPolicy (``cni: cilium``), beside its NetworkPolicy:
    DNS to the resolver through Cilium's DNS proxy (only the allowed names; the proxy
    learns the answers), and ``toFQDNs`` for the allowed names on TCP — the CNI opens
    exactly the addresses the resolver handed out, for their TTL. Plain dict: the CRD
    has no generated model. None for other policies."""
    policy: EgressPolicy = spec.egress_policy
    if policy.mode != "allow" or config.cni != "cilium":
        return None
    meta = _meta(config, spec, "-fqdn")
    dns_rules = [fqdn_selector(n) for n in policy.names] or [{"matchName": "invalid."}]
    egress: list[dict[str, Any]] = [
        {
            "toEndpoints": [
                {
                    "matchLabels": {
                        "k8s:io.kubernetes.pod.namespace": config.controlplane_namespace,
                        **{f"k8s:{k}": v for k, v in RESOLVER_POD_LABELS.items()},
                    }
                }
            ],
            "toPorts": [
                {
                    "ports": [
                        {"port": str(config.resolver_port), "protocol": "ANY"},
                        {"port": "53", "protocol": "ANY"},
                    ],
                    "rules": {"dns": dns_rules},
                }
            ],
        }
    ]
    if policy.names:
        egress.append(
            {
                "toFQDNs": [fqdn_selector(n) for n in policy.names],
                "toPorts": [{"ports": [{"port": "0", "protocol": "TCP"}]}],
            }
        )
    return {
        "apiVersion": f"{CILIUM_GROUP}/{CILIUM_VERSION}",
        "kind": "CiliumNetworkPolicy",
        "metadata": {
            "name": meta.name,
            "namespace": meta.namespace,
            "labels": {**meta.labels, L_EGRESS: "fqdn"},
        },
        "spec": {
            "endpointSelector": {
                "matchLabels": {
                    L_INSTANCE: config.instance,
                    L_SANDBOX: spec.sandbox_id,
                    L_GENERATION: str(spec.generation),
                }
            },
            "egress": egress,
        },
    }


def apply_pod_dns(pod: Any, config: KubernetesConfig, policy: EgressPolicy) -> None:
    """With the installation's resolver, every sandbox pod asks it only (its cluster
    DNS would resolve anything): the pod's DNS is fixed at create, and a live change
    to an allowlist needs it (``set_egress``)."""
    if config.resolver_ip:
        pod.spec.dns_policy, pod.spec.dns_config = allowlist_dns(config.resolver_ip)


def uses_resolver(pod: dict[str, Any], config: KubernetesConfig) -> bool:
    """Whether a pod (the API server's JSON) asks the installation's resolver only."""
    spec = pod.get("spec") or {}
    nameservers = (spec.get("dnsConfig") or {}).get("nameservers")
    return spec.get("dnsPolicy") == "None" and nameservers == [config.resolver_ip]


@dataclass
class AllowlistEgress:
    """Resolutions → NetworkPolicies for one installation (``policies`` is the
    backend's ``Kind`` for NetworkPolicies; ``api`` its retrying caller)."""

    api: Any
    policies: Any
    config: KubernetesConfig

    def resolved(
        self,
        *,
        labels: dict[str, str],
        sandbox_id: str,
        generation: int,
        name: str,
        answers: list[tuple[str, int]],
        grace_s: int,
        now: float | None = None,
        policy: EgressPolicy | None = None,
    ) -> list[str]:
        """Opens each (address, ttl) the resolver handed out for ``name`` to the
        sandbox's generation until ttl (≤ 3600) + grace. Denied addresses (link-local,
        loopback, …) open nothing, as on the local backend; nor do cluster-internal
        ones (``egress_except``: pod and Service ranges) unless ``policy`` lists a CIDR
        holding them. ``labels``: the sandbox's own (specs.sandbox_labels). Returns the
        names of the policies created."""
        now = time.time() if now is None else now
        made = []
        for address, ttl in answers:
            if not self.opens(address, policy):
                continue
            ip = ipaddress.IPv4Address(address)
            expires = int(now + min(max(ttl, 0), 3600) + grace_s)
            suffix = f"-r{int(ip):08x}-{expires}"
            body = client.V1NetworkPolicy(
                api_version="networking.k8s.io/v1",
                kind="NetworkPolicy",
                metadata=client.V1ObjectMeta(
                    name=object_name(sandbox_id, generation, suffix),
                    namespace=self.config.namespace,
                    labels={**labels, L_EGRESS: "resolved"},
                    annotations={A_EXPIRES: str(expires), A_NAME: name},
                ),
                spec=client.V1NetworkPolicySpec(
                    pod_selector=_selector(self.config, sandbox_id, generation),
                    policy_types=["Egress"],
                    egress=[
                        client.V1NetworkPolicyEgressRule(
                            to=[
                                client.V1NetworkPolicyPeer(
                                    ip_block=client.V1IPBlock(cidr=f"{address}/32")
                                )
                            ],
                            ports=[client.V1NetworkPolicyPort(protocol="TCP")],
                        )
                    ],
                ),
            )
            try:
                self.api.call(self.policies.create, self.config.namespace, body)
            except ApiException as exc:
                if exc.status != 409:  # the same second's answer twice: already open
                    raise BackendError(
                        f"cannot open {address} for {name}: {exc.status} {exc.reason}",
                        transient=True,
                    ) from exc
            made.append(body.metadata.name)
        return made

    def opens(self, address: str, policy: EgressPolicy | None) -> bool:
        """Whether a resolved ``address`` may be opened at all."""
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            return False
        if any(ip in net for net in FORBIDDEN_NETWORKS):
            return False
        internal = [ipaddress.IPv4Network(c) for c in self.config.egress_except if ":" not in c]
        if any(ip in net for net in internal):
            listed = policy.cidrs if policy is not None else ()
            return any(ip in rule.network for rule in listed)
        return True

    def close_unallowed(self, sandbox_id: str, policy: EgressPolicy) -> list[str]:
        """Deletes the sandbox's resolved policies for names ``policy`` does not allow
        any more (all of them unless it is an allowlist); returns their names."""
        selector = f"{self.config.sandbox_selector(sandbox_id)},{L_EGRESS}=resolved"
        listing = self.api.call(
            self.policies.listing, self.config.namespace, label_selector=selector
        )
        gone = []
        for obj in listing.items:
            name = (obj.metadata.annotations or {}).get(A_NAME, "")
            if policy.mode == "allow" and policy.allows_name(name):
                continue
            self._delete(obj.metadata.name)
            gone.append(obj.metadata.name)
        return gone

    def _delete(self, name: str) -> None:
        try:
            self.api.call(self.policies.delete, name, self.config.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(
                    f"cannot delete {name}: {exc.status} {exc.reason}", transient=True
                ) from exc

    def sweep(self, *, now: float | None = None) -> list[str]:
        """Deletes the installation's resolved policies whose expiry passed; returns
        their names. Idempotent (a policy deleted meanwhile is skipped)."""
        now = time.time() if now is None else now
        selector = f"{L_INSTANCE}={self.config.instance},{L_EGRESS}=resolved"
        listing = self.api.call(
            self.policies.listing, self.config.namespace, label_selector=selector
        )
        gone = []
        for obj in listing.items:
            annotations = obj.metadata.annotations or {}
            try:
                expires = float(annotations.get(A_EXPIRES, "0"))
            except ValueError:
                expires = 0.0
            if expires > now:
                continue
            self._delete(obj.metadata.name)
            gone.append(obj.metadata.name)
        return gone
