"""Writes for the money side: a tenant's limits (tenants, members and keys are
``apps.tenancy.services``)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlsplit

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
        name: {
            "old": _plain(getattr(quota, name), redact=name in REDACTED),
            "new": _plain(value, redact=name in REDACTED),
        }
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
# Settings owners may change themselves (the Usage page, ``PATCH /api/v1/budget``).
OWNER_SETTINGS = ("team_budget", "budget_alert", "alert_webhook_url")
# Never written back anywhere readable: the activity log says only "set" / "none".
REDACTED = frozenset({"alert_webhook_url"})


def parse_amount(value: str, *, field: str) -> Decimal | None:
    """A dollar amount an owner typed ("$1,250.50"): cents at most, 0.01 to 1e9; empty
    is None. Anything else is a ``ValidationFailed`` naming ``field``."""
    text = value.strip().removeprefix("$").replace(",", "")
    if not text:
        return None
    try:
        amount: Decimal | None = Decimal(text)
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
            f"or leave it empty for {'no alert' if field == 'budget_alert' else 'none'}.",
            field=field,
        )
    return amount.quantize(Decimal("0.01"))


def parse_webhook_url(value: str) -> str:
    """An http(s) URL with a host, or empty for none. Where it may point is checked at
    each delivery (``notices.webhook_target``), since names can change what they resolve to."""
    text = value.strip()
    if not text:
        return ""
    parts = urlsplit(text)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or len(text) > 2000
        or any(c.isspace() for c in text)
    ):
        raise ValidationFailed(
            "Enter an http:// or https:// URL (at most 2,000 characters), or leave it "
            "empty for none.",
            field="alert_webhook_url",
        )
    return text


def owner_settings_update(*, quota: TenantQuota, values: dict[str, Any], actor: str) -> TenantQuota:
    """What a team's owners and admins may change of their limits: their own hard
    budget, their alert and the webhook a crossing is POSTed to. Every value is checked
    before anything changes (one bad field: a ``ValidationFailed`` naming it, nothing
    written); a change is one ``quota.changed`` entry (the webhook only as set/none)."""
    unknown = sorted(set(values) - set(OWNER_SETTINGS))
    if unknown:
        raise ValidationFailed(
            f"unknown setting {unknown[0]!r}; one of {', '.join(OWNER_SETTINGS)}",
            field=unknown[0],
        )
    changes: dict[str, Any] = {}
    for name, raw in values.items():
        if raw is not None and not isinstance(raw, (str, int, float, Decimal)):
            raise ValidationFailed(f"{name} must be a string or null", field=name)
        text = "" if raw is None else str(raw)
        if name == "alert_webhook_url":
            changes[name] = parse_webhook_url(text)
        else:
            changes[name] = parse_amount(text, field=name)
    return quota_update(quota=quota, changes=changes, actor=actor)


def budget_alert_set(*, quota: TenantQuota, value: str, actor: str) -> TenantQuota:
    """An owner's spending alert: a dollar amount (cents at most; 0.01 to 1e9), or
    empty to clear it. Bad input is a ``ValidationFailed`` naming the field and
    nothing changes; a change is in the team's activity log like any limit's."""
    return owner_settings_update(quota=quota, values={"budget_alert": value}, actor=actor)


def team_budget_set(*, quota: TenantQuota, value: str, actor: str) -> TenantQuota:
    """The owners' own hard monthly budget (``check_budget`` refuses new sandboxes once
    month-to-date spend reaches it); same amounts and refusals as the alert."""
    return owner_settings_update(quota=quota, values={"team_budget": value}, actor=actor)


def _plain(value: Any, *, redact: bool = False) -> Any:
    """A JSON-safe copy of a limit's value (Decimals become strings); a redacted one is
    only "set" or None."""
    if redact:
        return "set" if value else None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
