from __future__ import annotations

import json
from typing import Any

from django import template

from apps.sandboxes.api.serializers import render_stream
from apps.trajectories.services.step_schema import stream_problem

register = template.Library()


@register.filter
def stream_text(meta: Any) -> str:
    """A stdout/stderr record as a reader sees it: whole, or head + marker + tail. A
    record stored before steps were checked on append may be malformed: said so."""
    if not isinstance(meta, dict):
        return ""
    if stream_problem(meta, "stream") is not None:
        return "[malformed output record]"
    return render_stream(meta)


@register.filter
def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


@register.filter
def pretty(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
