"""Admission: may this tenant start one more sandbox now?

Runs inside the create transaction. The cluster-wide cap is enforced here; per-tenant
quotas plug in through ``apps.billing.quotas`` when that module exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings

from apps.billing.models import Tenant
from apps.sandboxes.models import LIVE_STATES, Sandbox
from controlplane.errors import ApiError

if TYPE_CHECKING:
    from apps.sandboxes.services.lifecycle import SandboxRequest


class QuotaExceeded(ApiError):
    status_code = 429
    code = "quota_exceeded"


def admission_check(*, tenant: Tenant, request: SandboxRequest) -> None:
    limit = getattr(settings, "HEDGEROW_MAX_LIVE_SANDBOXES", 0)
    if limit:
        live = Sandbox.objects.filter(state__in=LIVE_STATES).count()
        if live >= limit:
            raise QuotaExceeded(
                f"the cluster runs its maximum of {limit} live sandboxes ({live} now)",
                headers={"Retry-After": "5"},
                extra={"limit": "cluster_live_sandboxes", "value": limit, "current": live},
            )
