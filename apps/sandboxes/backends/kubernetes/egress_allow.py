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


def _selector(config: KubernetesConfig, sandbox_id: str, generation: int) -> Any:
    return client.V1LabelSelector(
        match_labels={
            L_INSTANCE: config.instance,
            L_SANDBOX: sandbox_id,
            L_GENERATION: str(generation),
        }
    )


def allowlist_dns(resolver_ip: str) -> tuple[str, Any]:
    """(dnsPolicy, dnsConfig) of an allowlist sandbox's pod: the resolver only."""
    return "None", client.V1PodDNSConfig(
        nameservers=[resolver_ip],
        searches=[],
        options=[client.V1PodDNSConfigOption(name="ndots", value="1")],
    )


def build_allowlist_policy(
    config: KubernetesConfig,
    meta: Any,
    sandbox_id: str,
    generation: int,
    policy: EgressPolicy,
    resolver_ip: str,
) -> Any:
    """The base policy of an allowlist sandbox: DNS to the resolver, and the CIDR:port
    entries. ``meta``: the sandbox's object metadata (specs._meta), suffix ``-egress``."""
    meta.labels = {**(meta.labels or {}), L_EGRESS: "allowlist"}
    dns = client.V1NetworkPolicyEgressRule(
        to=[client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=f"{resolver_ip}/32"))],
        ports=[
            client.V1NetworkPolicyPort(protocol="UDP", port=53),
            client.V1NetworkPolicyPort(protocol="TCP", port=53),
        ],
    )
    rules = [dns]
    for rule in policy.cidrs:
        rules.append(
            client.V1NetworkPolicyEgressRule(
                to=[client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=str(rule.network)))],
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


def check_supported(config: KubernetesConfig, policy: EgressPolicy) -> None:
    """An allowlist needs the in-cluster resolver's address (``resolver_ip``): without
    it the sandbox is refused, never given the whole network instead."""
    if policy.mode == "allow" and not config.resolver_ip:
        raise BackendError(
            "egress allowlists on kubernetes need the in-cluster resolver (resolver_ip)"
        )


def egress_policy_for(config: KubernetesConfig, spec: Any) -> Any:
    """The sandbox's own egress NetworkPolicy: an allowlist's base policy, or None
    (the caller builds the "all" policy, or none for "none")."""
    policy: EgressPolicy = spec.egress_policy
    if policy.mode != "allow":
        return None
    meta = client.V1ObjectMeta(
        name=object_name(spec.sandbox_id, spec.generation, "-egress"),
        namespace=config.namespace,
        labels=sandbox_labels(
            config, tenant_id=spec.tenant_id, sandbox_id=spec.sandbox_id, generation=spec.generation
        ),
    )
    return build_allowlist_policy(
        config, meta, spec.sandbox_id, spec.generation, policy, config.resolver_ip
    )


def apply_pod_dns(pod: Any, config: KubernetesConfig, policy: EgressPolicy) -> None:
    """An allowlist sandbox's pod asks the resolver only (its cluster DNS would resolve
    anything)."""
    if policy.mode == "allow":
        pod.spec.dns_policy, pod.spec.dns_config = allowlist_dns(config.resolver_ip)


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
    ) -> list[str]:
        """Opens each (address, ttl) the resolver handed out for ``name`` to the
        sandbox's generation until ttl (≤ 3600) + grace. Denied addresses (link-local,
        loopback, …) open nothing, as on the local backend. ``labels``: the sandbox's
        own (specs.sandbox_labels). Returns the names of the policies created."""
        now = time.time() if now is None else now
        made = []
        for address, ttl in answers:
            ip = ipaddress.ip_address(address)
            if not isinstance(ip, ipaddress.IPv4Address) or any(
                ip in net for net in FORBIDDEN_NETWORKS
            ):
                continue
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
            try:
                self.api.call(self.policies.delete, obj.metadata.name, self.config.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise BackendError(
                        f"cannot delete {obj.metadata.name}: {exc.status} {exc.reason}",
                        transient=True,
                    ) from exc
            gone.append(obj.metadata.name)
        return gone
