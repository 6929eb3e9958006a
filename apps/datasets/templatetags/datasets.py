"""Where the time goes, as a panel the episode and trajectories pages include:
``{% load datasets %}{% episode_time_panel episode %}`` / ``{% episodes_time_panel %}``."""

from __future__ import annotations

from typing import Any

from django import template

from apps.core.errors import ApiError
from apps.datasets.services.timing import AGGREGATE_LIMIT, PARTS, episode_time, episodes_time
from apps.trajectories import selectors as episode_selectors
from apps.trajectories.models import Episode

register = template.Library()

LABELS = {
    "model_s": "model calls",
    "environment_s": "environment (execs, tools)",
    "verifier_s": "verifier",
    "other_s": "harness / other",
}


def _bars(values: dict[str, Any]) -> list[dict[str, Any]]:
    total = sum((values.get(k) or 0.0) for k in PARTS)
    return [
        {
            "key": k,
            "label": LABELS[k],
            "seconds": values.get(k),
            "pct": round(100 * (values.get(k) or 0.0) / total, 1) if total else 0.0,
        }
        for k in PARTS
    ]


@register.inclusion_tag("datasets/_time.html")
def episode_time_panel(episode: Episode) -> dict[str, Any]:
    data = episode_time(episode)
    return {"data": data, "bars": _bars(data), "scope": "episode"}


@register.inclusion_tag("datasets/_time.html", takes_context=True)
def episodes_time_panel(context: template.Context) -> dict[str, Any]:
    principal = context.get("principal")
    filters = {k: v for k, v in (context.get("filters") or {}).items() if v}
    if principal is None:
        return {"data": None}
    try:
        qs = episode_selectors.episode_list(tenant=principal.tenant, filters=filters)
    except ApiError:
        return {"data": None}
    data = episodes_time(qs)
    return {
        "data": data["total"],
        "aggregate": data,
        "bars": _bars(data["total"]),
        "scope": "aggregate",
        "limit": AGGREGATE_LIMIT,
    }


@register.filter
def seconds(value: Any) -> str:
    if value is None:
        return "—"
    value = float(value)
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.2f} s"
