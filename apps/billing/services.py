"""Writes for the money side: a tenant's limits (tenants, members and keys are
``apps.tenancy.services``)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from apps.billing.models import TenantQuota
from apps.core.errors import ValidationFailed
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


BUDGET_ALERT_MAX = Decimal("1000000000")


def budget_alert_set(*, quota: TenantQuota, value: str, actor: str) -> TenantQuota:
    """An owner's spending alert: a dollar amount (cents at most; 0.01 to 1e9), or
    empty to clear it. Bad input is a ``ValidationFailed`` naming the field and
    nothing changes; a change is in the team's activity log like any limit's."""
    text = value.strip().removeprefix("$").replace(",", "")
    amount: Decimal | None = None
    if text:
        try:
            amount = Decimal(text)
        except InvalidOperation:
            amount = None
        if (
            amount is None
            or not amount.is_finite()
            or amount != amount.quantize(Decimal("0.01"))
            or not Decimal("0.01") <= amount <= BUDGET_ALERT_MAX
        ):
            raise ValidationFailed(
                "Enter an amount in dollars from 0.01 to 1,000,000,000 (cents at most), "
                "or leave it empty for no alert.",
                field="budget_alert",
            )
    return quota_update(quota=quota, changes={"budget_alert": amount}, actor=actor)


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a limit's value (Decimals become strings)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
