"""Writes for the money side: a tenant's limits (tenants, members and keys are
``apps.tenancy.services``)."""

from __future__ import annotations

from typing import Any

from apps.billing.models import TenantQuota


def quota_update(*, quota: TenantQuota, changes: dict[str, Any]) -> TenantQuota:
    """Applies staff edits to a tenant's limits. Admission reads the row under lock on
    every create, so new limits apply to the next create; hot-path limits within
    seconds (each web process caches them briefly)."""
    for name, value in changes.items():
        setattr(quota, name, value)
    quota.save()
    return quota
