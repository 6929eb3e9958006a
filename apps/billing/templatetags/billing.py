"""``{% load billing %}{% quota_bars %}``: the team's quota-use bars on any dashboard page
that has ``tenant`` in its context (the sandboxes page uses it)."""

from __future__ import annotations

from typing import Any

from django import template

from apps.billing.quotas import quota_usage
from apps.billing.views import quota_bars as bars_for

register = template.Library()


@register.inclusion_tag("billing/_quota_bars.html", takes_context=True)
def quota_bars(context: template.Context) -> dict[str, Any]:
    tenant = context.get("tenant")
    return {"bars": bars_for(quota_usage(tenant=tenant)) if tenant is not None else []}
