"""A sandbox's egress: quotas of policies, the change of a live sandbox's policy, and
its DNS query log (the resolver's, read from the backend)."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.db import transaction

from apps.billing.errors import QuotaForbidden, limit_error
from apps.billing.quotas import quota_get
from apps.core.egress import NONE, EgressPolicy, parse_egress, uncovered
from apps.core.errors import Conflict, ValidationFailed
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.models import Sandbox, State
from apps.tenancy.models import Tenant

MAX_DNS_LOG = 1000


def sandbox_dns_log(*, sandbox: Sandbox, limit: int = MAX_DNS_LOG) -> list[dict[str, Any]]:
    """The sandbox's DNS queries as the instance's resolver logged them, oldest first:
    ts, generation, name, type, allowed, rcode, answer [{address, ttl}], flags. Empty
    for a backend without a resolver, and once the sandbox's backend state is gone."""
    reader = getattr(get_backend(), "dns_log", None)
    if reader is None:
        return []
    entries: list[dict[str, Any]] = reader(sandbox.id.hex, max(1, min(limit, MAX_DNS_LOG)))
    return entries


def egress_supported_check(*, policy: EgressPolicy, backend_name: str) -> None:
    """A policy the backend cannot enforce is a 400 ``egress_unsupported``, never a
    wider one: allowlists need the local backend, or the kubernetes backend with its
    in-cluster resolver (``HEDGEROW_K8S_RESOLVER_IP``), where ``"match": "sni"`` is not
    enforced (docs/egress.md "Kubernetes")."""
    if policy.mode != "allow" or backend_name == "local":
        return
    if backend_name == "kubernetes" and settings.HEDGEROW_K8S_RESOLVER_IP:
        if policy.match != "sni":
            return
        message = 'egress "match": "sni" is not enforced on kubernetes (docs/egress.md)'
    else:
        message = (
            "egress allowlists need the local backend, or kubernetes with its in-cluster "
            "resolver (HEDGEROW_K8S_RESOLVER_IP; docs/egress.md)"
        )
    raise ValidationFailed(message, field="egress", extra={"reason": "egress_unsupported"})


def egress_quota_check(*, tenant: Tenant, policy: EgressPolicy) -> None:
    """The tenant's quota permits ``policy`` (docs/egress.md "Quotas"), else a 403
    ``quota_exceeded`` naming the limit and the entries it refuses."""
    quota = quota_get(tenant=tenant)
    if policy.mode == "all" and not quota.egress_allow_all:
        raise limit_error(
            QuotaForbidden,
            limit="egress_allow_all",
            value=False,
            current="all",
            message="this team's sandboxes may not have egress 'all': give an allowlist",
        )
    if policy.mode != "allow" or quota.egress_patterns is None:
        return
    permitted = parse_egress({"allow": quota.egress_patterns}) if quota.egress_patterns else NONE
    refused = uncovered(policy, permitted)
    if refused:
        raise limit_error(
            QuotaForbidden,
            limit="egress_patterns",
            value=quota.egress_patterns,
            current=refused,
            message=f"not within this team's egress patterns: {', '.join(refused)}",
        )


def sandbox_set_egress(*, sandbox: Sandbox, egress: Any, actor: str) -> Sandbox:
    """Changes a ready sandbox's policy: the backend first (new connections follow it at
    once), then the row and one ``egress_changed`` ledger event with old and new."""
    from apps.sandboxes.services.lifecycle import egress_policy, sandbox_record_event

    policy = egress_policy(egress)
    if sandbox.state != State.READY:
        raise Conflict(
            f"the egress of a {sandbox.state} sandbox cannot change",
            code="sandbox_not_ready",
            extra={"state": sandbox.state},
        )
    egress_supported_check(policy=policy, backend_name=sandbox.backend)
    egress_quota_check(tenant=sandbox.tenant, policy=policy)
    old = sandbox.egress
    new = policy.to_json()
    if old == new:
        return sandbox
    setter = getattr(get_backend(), "set_egress", None)
    if setter is None:
        raise Conflict(
            "this backend cannot change a live sandbox's egress",
            code="egress_change_unsupported",
        )
    try:
        setter(sandbox.id.hex, policy)
    except BackendError as exc:
        raise Conflict(str(exc), code="egress_change_failed") from exc
    with transaction.atomic():
        Sandbox.objects.filter(pk=sandbox.pk).update(egress=new, network_access=policy.routed)
        sandbox.egress, sandbox.network_access = new, policy.routed
        sandbox_record_event(
            sandbox=sandbox,
            event="egress_changed",
            reason="api",
            message=json.dumps({"from": old, "to": new}, separators=(",", ":")),
            actor=actor,
        )
    return sandbox
