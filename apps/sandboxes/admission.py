"""Admission: may this tenant start one more sandbox now, or must it wait?

Runs inside the create transaction. The rules (cluster cap, per-tenant and per-key
quotas, budget, the admission queue) live with billing in ``apps.billing.quotas`` and
``apps.billing.admission_queue``; this is the one hook the create path calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apps.billing.admission_queue import admission_decide
from apps.billing.errors import QuotaExceeded
from apps.billing.quotas import Ask
from apps.tenancy.models import Tenant

if TYPE_CHECKING:
    from apps.sandboxes.services.lifecycle import SandboxRequest

__all__ = ["QuotaExceeded", "admission_check"]


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
