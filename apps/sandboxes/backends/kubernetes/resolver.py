"""The in-cluster resolver (docs/egress.md "Kubernetes"): the local backend's filtering
resolver (``local/resolver.py``: the same query handling, rate limits, tunnelling
flags and log entries), run as a Deployment behind a Service whose ClusterIP is
``resolver_ip`` (deploy/base/resolver.yaml, ``manage.py hedgerow_k8s_resolver``).
What differs is only where it looks and writes:

* who asks: the sandbox pod whose ``status.podIP`` is the query's source address (a
  LIST by field selector, this installation's sandbox pods only; none or several:
  REFUSED; one being deleted or ended does not count), its sandbox and generation from
  its labels, its policy from the
  ``hedgerow.dev/egress-policy`` annotation of its ``-egress`` NetworkPolicy (no such
  policy: "none"). The control plane writes that annotation at create and on a live
  change (``set_egress``); a lookup is kept ``cache_s`` seconds, so a change applies
  to queries from then on;
* what an answer opens: a ``/32`` NetworkPolicy per address until TTL + grace
  (``AllowlistEgress.resolved``), created before the answer is sent; with Cilium
  (``cni: cilium``) nothing: the CiliumNetworkPolicy's ``toFQDNs`` learns the answer
  through Cilium's DNS proxy. Expired ``/32`` policies are swept every ``SWEEP_S``;
* the log: ``dnslog.py`` (Redis), read by the control plane's ``dns_log``.

The pod source address cannot be forged by a sandbox: NetworkPolicies and the CNI
bind a pod's traffic to its own address, and a sandbox has no NET_ADMIN/NET_RAW.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from apps.core.egress import NONE, EgressError, EgressPolicy, parse_egress
from apps.sandboxes.backends.local import resolver as local

from . import dnslog
from .config import (
    L_COMPONENT,
    L_GENERATION,
    L_INSTANCE,
    L_SANDBOX,
    L_TENANT,
    MANAGED_BY,
    KubernetesConfig,
    object_name,
)
from .egress_allow import A_POLICY, AllowlistEgress

log = logging.getLogger(__name__)

SWEEP_S = 10.0
# a /32 policy carries the sandbox's own labels (so destroy and the inventory find it)
SANDBOX_LABEL_KEYS = frozenset(
    {MANAGED_BY, L_INSTANCE, L_TENANT, L_SANDBOX, L_GENERATION, L_COMPONENT}
)


@dataclass
class PodClient(local.Client):
    labels: dict[str, str] = field(default_factory=dict)


class PodDirectory:
    """Source address → the sandbox pod with that address, and its policy."""

    def __init__(
        self, api: Any, policies: Any, config: KubernetesConfig, *, cache_s: float = 2.0
    ) -> None:
        self.api = api
        self.policies = policies
        self.config = config
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, PodClient | None]] = {}
        self._buckets: dict[str, PodClient] = {}  # the token bucket survives a re-read

    def lookup(self, ip: str) -> PodClient | None:
        now = time.monotonic()
        held = self._cache.get(ip)
        if held is not None and now - held[0] < self.cache_s:
            return held[1]
        try:
            found = self._read(ip)
        except (ApiException, OSError) as exc:  # the API unavailable: refuse, never guess
            log.warning("pod lookup of %s failed: %s", ip, exc)
            return None
        if found is not None:
            before = self._buckets.get(ip)
            if before is not None and before.sandbox_id == found.sandbox_id:
                found.tokens, found.at = before.tokens, before.at
            self._buckets[ip] = found
        self._cache[ip] = (now, found)
        return found

    def _read(self, ip: str) -> PodClient | None:
        ns = self.config.namespace
        pods, _ = self.api.list_json(
            f"/api/v1/namespaces/{ns}/pods",
            labelSelector=self.config.sandbox_selector(),
            fieldSelector=f"status.podIP={ip}",
        )
        # a pod that ended keeps its address in its status while the address may already
        # be another pod's: only a live one speaks for it
        live = [
            p
            for p in pods
            if not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        if len(live) != 1:
            return None
        labels = dict(live[0]["metadata"].get("labels") or {})
        sandbox_id = labels.get(L_SANDBOX, "")
        raw_generation = labels.get(L_GENERATION, "")
        if not sandbox_id or not raw_generation.isdigit():
            return None
        generation = int(raw_generation)
        return PodClient(
            sandbox_id, generation, self._policy(sandbox_id, generation), labels=labels
        )

    def _policy(self, sandbox_id: str, generation: int) -> EgressPolicy:
        name = object_name(sandbox_id, generation, "-egress")
        try:
            obj = self.api.call(self.policies.read, name, self.config.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return NONE
            raise
        raw = (obj.metadata.annotations or {}).get(A_POLICY)
        if raw is None:
            return NONE
        try:
            return parse_egress(json.loads(raw))
        except (ValueError, EgressError):
            return NONE


class ClusterResolver(local.Resolver):
    def __init__(
        self,
        directory: PodDirectory,
        upstream: tuple[str, int],
        egress: AllowlistEgress,
        redis: Any,
        *,
        grace_s: int = 30,
    ) -> None:
        super().__init__(Path("/nonexistent"), upstream, _never, directory)  # no files
        self.pods = directory
        self.egress = egress
        self.redis = redis
        self.grace_s = grace_s

    def open_addresses(
        self, client: local.Client, source: str, name: str, addresses: list[tuple[str, int]]
    ) -> None:
        if self.egress.config.cni == "cilium":
            return  # the CiliumNetworkPolicy's toFQDNs learns the answer itself
        labels = client.labels if isinstance(client, PodClient) else {}
        self.egress.resolved(
            labels={k: v for k, v in labels.items() if k in SANDBOX_LABEL_KEYS},
            sandbox_id=client.sandbox_id,
            generation=client.generation,
            name=name,
            answers=addresses,
            grace_s=self.grace_s,
            policy=client.policy,
        )

    def _log(self, client: local.Client, entry: dict[str, Any]) -> None:
        try:
            dnslog.append(self.redis, self.egress.config.instance, client.sandbox_id, entry)
        except Exception as exc:  # noqa: BLE001 - a lost log line must not drop the answer
            log.warning("dns log for %s: %s", client.sandbox_id, exc)


def _never(source: str, addresses: list[tuple[str, int]]) -> None:
    raise AssertionError("ClusterResolver opens addresses with NetworkPolicies")


async def sweeper(egress: AllowlistEgress, every_s: float = SWEEP_S) -> None:
    """Deletes expired /32 policies, every ``every_s``."""
    loop = asyncio.get_running_loop()
    while True:
        with contextlib.suppress(Exception):
            gone = await loop.run_in_executor(None, egress.sweep)
            if gone:
                log.info("closed %d expired address(es)", len(gone))
        await asyncio.sleep(every_s)  # a period, not a synchronisation


def run(resolver: ClusterResolver, listen: str, port: int) -> None:
    """Serves until killed (the Deployment restarts it)."""

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(sweeper(resolver.egress))
        try:
            await local.serve(
                resolver,
                listen,
                port,
                lambda: log.info("resolver on %s:%s → %s", listen, port, resolver.upstream),
            )
        finally:
            task.cancel()

    asyncio.run(main())
