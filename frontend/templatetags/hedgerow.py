"""Small presentation helpers: shortened ids with copy, times the browser localises."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import template
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import SafeString

from apps.sandboxes.admission.queue import queue_position as _queue_position

register = template.Library()

COPY_ICON = (
    '<svg viewBox="0 0 16 16" aria-hidden="true"><path fill="currentColor" d="M5 2h7a2 2 0 0 1 '
    "2 2v7h-1.5V4a.5.5 0 0 0-.5-.5H5V2Zm-2 3h7a2 2 0 0 1 2 2v6a2 2 0 0 1-2 2H3a2 2 0 0 1-2-2V7a2 "
    "2 0 0 1 2-2Zm0 1.5a.5.5 0 0 0-.5.5v6a.5.5 0 0 0 .5.5h7a.5.5 0 0 0 .5-.5V7a.5.5 0 0 0"
    '-.5-.5H3Z"/></svg>'
)


def shorten(value: str, keep: int = 14) -> str:
    return value if len(value) <= keep + 1 else f"{value[: keep - 4]}…{value[-4:]}"


@register.simple_tag
def short_id(value: object, href: str = "", keep: int = 14) -> SafeString:
    """The id shortened, the full id on hover, and a copy button."""
    full = str(value)
    label = shorten(full, keep)
    inner = (
        format_html('<a href="{}" title="{}">{}</a>', href, full, label)
        if href
        else format_html('<span title="{}">{}</span>', full, label)
    )
    return format_html(
        '<span class="id">{}<button type="button" class="copy" data-copy="{}" '
        'aria-label="Copy {}" title="Copy">{}</button></span>',
        inner,
        full,
        full,
        SafeString(COPY_ICON),
    )


def _as_datetime(value: datetime | str | None) -> datetime | None:
    """Report rows carry ISO strings (they are also the JSON API's shape); pages want times."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value) if value else None
        except ValueError:
            return None
    return value


@register.simple_tag
def reltime(value: datetime | str | None, empty: str = "—") -> SafeString:
    """A <time> the browser renders as a relative age, with the local time on hover."""
    value = _as_datetime(value)
    if value is None:
        return format_html('<span class="muted">{}</span>', empty)
    return format_html(
        '<time datetime="{}" data-rel>{}</time>',
        value.isoformat(),
        value.strftime("%Y-%m-%d %H:%M UTC"),
    )


@register.simple_tag
def localtime_tag(
    value: datetime | str | None, empty: str = "—", seconds: bool = False
) -> SafeString:
    """Local time (the browser localises it); ``seconds=True`` where seconds matter (a
    lifecycle: provisioning → ready within the same minute)."""
    value = _as_datetime(value)
    if value is None:
        return format_html('<span class="muted">{}</span>', empty)
    if seconds:
        return format_html(
            '<time datetime="{}" data-local="seconds">{}</time>',
            value.isoformat(),
            value.strftime("%Y-%m-%d %H:%M:%S UTC"),
        )
    return format_html(
        '<time datetime="{}" data-local>{}</time>',
        value.isoformat(),
        value.strftime("%Y-%m-%d %H:%M UTC"),
    )


@register.simple_tag
def until(value: datetime | str | None, empty: str = "—") -> SafeString:
    """Time left until a deadline (TTL), counted down in the browser."""
    value = _as_datetime(value)
    if value is None:
        return format_html('<span class="muted">{}</span>', empty)
    return format_html(
        '<time datetime="{}" data-until>{}</time>',
        value.isoformat(),
        value.strftime("%Y-%m-%d %H:%M UTC"),
    )


@register.simple_tag
def state_badge(state: str) -> SafeString:
    return format_html(
        '<span class="badge state-{}" data-state="{}">{}</span>', state, state, state
    )


@register.filter
def cpu_cores(millis: int) -> str:
    cores = millis / 1000
    return f"{cores:g} vCPU"


@register.filter
def mem_human(mib: int) -> str:
    return f"{mib / 1024:g} GiB" if mib >= 1024 and mib % 256 == 0 else f"{mib} MiB"


@register.filter
def filesize(size: int | None) -> str:
    if size is None:
        return ""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


@register.filter
def epoch(value: float | int | str) -> datetime:
    return datetime.fromtimestamp(float(value), tz=UTC)


@register.filter
def hours(value: Decimal | str | float | None) -> str:
    """Hours for people: two decimals ("1.25"), "<0.01" for a few seconds (never a
    misleading "0.00"), "0" for none. The API and CSV keep their four decimals."""
    if value is None or value == "":
        return "—"
    number = Decimal(str(value))
    if number == 0:
        return "0"
    if abs(number) < Decimal("0.01"):
        return "<0.01"
    return f"{number:,.2f}"


@register.filter
def money(value: Decimal | str | float | None) -> SafeString:
    """Dollars for people, one rule on every page: cents with thousands separators
    ("$1,234.50"), "$0.00" for nothing, and "<$0.01" for a nonzero amount under a cent
    (never a misleading "$0.00", never "$0.000002"), the exact amount in its tooltip.
    The API and CSV keep their own precision."""
    if value is None or value == "":
        return format_html("{}", "—")
    number = Decimal(str(value))
    sign = "-" if number < 0 else ""
    if number != 0 and abs(number) < Decimal("0.01"):
        exact = f"{sign}${abs(number).normalize():f}"
        return format_html('<span title="{}">{}</span>', exact, f"{sign}<$0.01")
    cents = abs(number).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)  # as invoices round
    return format_html("{}", f"{sign}${cents:,.2f}")


@register.filter
def queue_position(sandbox: Any) -> int | None:
    """``{{ sandbox|queue_position }}``: its place in the admission queue, or None."""
    return _queue_position(sandbox=sandbox)


# Where a long file name may wrap: after a separator, or between a lower-case letter or
# digit and an upper-case one (camelCase). Not mid-word.
_WBR = SafeString("<wbr>")
_WRAP_AFTER = re.compile(r"([_\-./@+,=~]+|(?<=[a-z0-9])(?=[A-Z]))")


@register.filter
def breakable(value: object) -> SafeString:
    """``value`` escaped, with ``<wbr>`` where it may wrap: a long name breaks after its
    separators (``_ - . /`` …) instead of at whatever letter reaches the edge. A part
    longer than the whole column still breaks (CSS ``overflow-wrap``), as a last resort."""
    parts = _WRAP_AFTER.split(str(value))
    out = SafeString("")
    for i, part in enumerate(parts):
        out += conditional_escape(part)
        if i % 2 == 1 and i < len(parts) - 1:
            out += _WBR  # after a separator (odd parts are the separators)
    return out
