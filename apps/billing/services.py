"""Writes for the money side: a tenant's limits (tenants, members and keys are
``apps.tenancy.services``)."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from apps.billing.models import TenantQuota
from apps.tenancy.activity import activity_record
from apps.tenancy.models import Action


def quota_update(
    *, quota: TenantQuota, changes: dict[str, Any], actor: str = "system"
) -> TenantQuota:
    """Applies staff edits to a tenant's limits. Admission reads the row under lock on
    every create, so new limits apply to the next create; hot-path limits within
    seconds (each web process caches them briefly). The team's activity log gets the
    old and new value of each limit that changed."""
    changed = {
        name: {"old": _plain(getattr(quota, name)), "new": _plain(value)}
        for name, value in changes.items()
        if getattr(quota, name) != value
    }
    with transaction.atomic():
        for name, value in changes.items():
            setattr(quota, name, value)
        quota.save()
        if changed:
            activity_record(
                tenant=str(quota.tenant_id),
                actor=actor,
                action=Action.QUOTA_CHANGED,
                target_type="quota",
                target_id=str(quota.tenant_id),
                target_name="team limits",
                details=changed,
            )
    return quota


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a limit's value (Decimals become strings)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
