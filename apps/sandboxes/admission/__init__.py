"""Admission: may this tenant start one more sandbox now, or must it wait?

Runs inside the create transaction; the one hook the create path (and a resume) calls.
Billing owns the limits and the money — the quota row and its lock, a key's limit, the
request and budget checks, the typed refusals (``apps.billing.quotas``,
``apps.billing.errors``); this package counts the use they are compared with
(``use.py``) and acts on the answer: start now, wait in the admission queue
(``queue.py``: fair order, drain, expiry), or refuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apps.billing.errors import QuotaExceeded, limit_error
from apps.billing.quotas import Ask, check_budget, check_request_fits, quota_lock_for
from apps.sandboxes.admission.use import (
    CLUSTER_LIMITS,
    capacity_shortfall,
    cluster_capped,
    tenant_use,
)
from apps.tenancy.models import Tenant

if TYPE_CHECKING:
    from apps.sandboxes.services.lifecycle import SandboxRequest

__all__ = ["QuotaExceeded", "admission_check", "admission_decide"]


def admission_check(*, tenant: Tenant, request: SandboxRequest, actor: str = "") -> bool:
    """True: start now. False: wait in the admission queue (state ``queued``).

    Raises QuotaExceeded (429 + Retry-After), QuotaForbidden or BudgetExhausted (403),
    each naming the limit, its value and the current use.
    """
    ask = Ask(
        cpu_millis=request.cpu_millis,
        memory_mib=request.memory_mib,
        ttl_seconds=request.ttl_seconds,
        actor=actor,
    )
    return admission_decide(tenant=tenant, ask=ask, queue=request.queue)


def admission_decide(*, tenant: Tenant, ask: Ask, queue: bool | None, count: int = 1) -> bool:
    """Inside the create transaction: True = start now, False = wait in the queue.

    Raises a typed error for a request that can never fit, an exhausted budget, or
    (without queueing) any limit in the way. With queueing, a tenant's new create
    waits behind its already queued ones, so its queue stays FIFO. ``count``: that
    many sandboxes of the ask's shape, decided as a whole under one quota lock (a
    fork's children; never queued: ``queue`` must be False).
    """
    if count != 1 and queue is not False:
        raise ValueError("several sandboxes are admitted whole or refused, never queued")
    cluster = cluster_capped()
    quota, key_max = quota_lock_for(tenant=tenant, actor=ask.actor, cluster=cluster)
    check_request_fits(quota=quota, ask=ask)
    check_budget(quota=quota)
    wants_queue = quota.queue_by_default if queue is None else queue
    # live use and queue length (and the cluster's, when capped), one statement
    use = tenant_use(tenant_id=tenant.pk, cluster=cluster)
    queued = use.queued
    shortfall = (
        None
        if (wants_queue and queued)
        else capacity_shortfall(
            quota=quota, ask=ask, use=use, key_max_sandboxes=key_max, count=count
        )
    )
    if not (wants_queue and queued) and shortfall is None:
        return True
    if (
        queue is None
        and count == 1
        and shortfall is not None
        and shortfall.extra.get("limit") in CLUSTER_LIMITS
    ):
        # The installation is full, not the team: unless the create said queue=false,
        # it waits its turn (position, Retry-After) instead of being refused.
        wants_queue = True
    if not wants_queue:
        assert shortfall is not None
        raise shortfall
    if queued >= quota.max_queued:
        raise limit_error(
            QuotaExceeded,
            limit="max_queued",
            value=quota.max_queued,
            current=queued,
            message=f"this team already has {queued} sandboxes waiting in the queue",
            retry=30,
        )
    return False
