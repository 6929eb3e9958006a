"""Billing pages: a team's Usage page and the staff cost report. Views call services,
selectors and reports only."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from apps.billing.api.usage_views import cost_report_csv, parse_window, window_end_date
from apps.billing.models import TenantQuota
from apps.billing.notices import notices_current
from apps.billing.quotas import quota_get, quota_usage
from apps.billing.reports import (
    COST_REPORT_COLUMNS,
    cost_by_key_of,
    cost_report,
    current_price_book,
    peak_concurrency,
    tenant_report,
    window_usage,
)
from apps.billing.services import owner_settings_update
from apps.core.errors import ValidationFailed
from apps.tenancy.pages import page, render_page, staff_page
from apps.tenancy.principal import Principal

QUOTA_LABELS = [
    ("concurrent_sandboxes", "Concurrent sandboxes", ""),
    ("cpu_millis", "vCPU of live sandboxes", "m"),
    ("memory_mib", "Memory of live sandboxes", "Mi"),
    ("concurrent_execs", "Concurrent execs", ""),
    ("pty_sessions", "Terminal sessions", ""),
    ("upload_bytes_per_day", "Uploads today", " B"),
    ("queued", "Waiting in the queue", ""),
]


def quota_bars(usage: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for the quota-use bars: label, current, limit and a 0-100 fill."""
    bars = []
    for key, label, unit in QUOTA_LABELS:
        entry = usage.get(key) or {}
        limit, current = entry.get("limit"), entry.get("current") or 0
        percent = min(100, round(100 * current / limit)) if limit else 0
        bars.append(
            {
                "key": key,
                "label": label,
                "unit": unit,
                "current": current,
                "limit": limit,
                "percent": percent,
                "level": "bad" if percent >= 100 else "warn" if percent >= 80 else "ok",
            }
        )
    return bars


def _window(request: HttpRequest, now: datetime | None = None) -> tuple[datetime, datetime, str]:
    try:
        start, end = parse_window(request.GET.dict(), now=now)
        return start, end, ""
    except ValidationFailed as exc:
        start, end = parse_window({}, now=now)
        return start, end, exc.message


def _chart(days: list[dict[str, Any]], field: str, label: str, unit: str) -> dict[str, Any]:
    return {
        "labels": [d["day"][5:] for d in days],
        "datasets": [{"label": label, "data": [float(Decimal(d[field])) for d in days]}],
        "unit": unit,
    }


@require_GET
@page()
def usage_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    return render_page(request, principal, "billing/usage.html", _usage_context(request, principal))


def _owner_setting_post(
    request: HttpRequest, principal: Principal, field: str, done: Callable[[TenantQuota], str]
) -> HttpResponse:
    """Owners change one of their settings, then back to the Usage page
    (post/redirect/get); a refused value re-renders the page with the error by it."""
    value = request.POST.get(field, "")
    try:
        quota = owner_settings_update(
            quota=quota_get(tenant=principal.tenant),
            values={field: value},
            actor=principal.actor,
        )
    except ValidationFailed as exc:
        context = _usage_context(request, principal)
        context["form_errors"] = {field: exc.message}
        # the webhook is never echoed back (it may carry a token), not even refused
        context["form_values"] = {field: "" if field == "alert_webhook_url" else value}
        return render_page(request, principal, "billing/usage.html", context)
    messages.success(request, done(quota))
    return redirect("billing:usage")


@require_POST
@page("admin")
def budget_alert_view(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The team's spending alert (a warning: nothing is refused)."""
    return _owner_setting_post(
        request,
        principal,
        "budget_alert",
        lambda q: "Spending alert cleared."
        if q.budget_alert is None
        else f"Spending alert set at ${q.budget_alert:,.2f} a month.",
    )


@require_POST
@page("admin")
def team_budget_view(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The team's own hard monthly budget (new sandboxes are refused once it is spent)."""
    return _owner_setting_post(
        request,
        principal,
        "team_budget",
        lambda q: "Team budget cleared."
        if q.team_budget is None
        else f"Team budget set at ${q.team_budget:,.2f} a month.",
    )


@require_POST
@page("admin")
def alert_webhook_view(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Where a crossed alert or budget is POSTed (never shown back: it may hold a token)."""
    return _owner_setting_post(
        request,
        principal,
        "alert_webhook_url",
        lambda q: "Webhook set." if q.alert_webhook_url else "Webhook removed.",
    )


def _usage_context(request: HttpRequest, principal: Principal) -> dict[str, Any]:
    tenant = principal.tenant
    # One clock and one read of the window for everything on the page: the report, the
    # cost per key (its key slices) and the month to date (its days from the 1st, when
    # the window holds them) share ``window_usage``; the quota bars take that month.
    now = timezone.now()
    start, end, error = _window(request, now)
    window = window_usage(tenant=tenant, start=start, end=end, now=now)
    full_report = tenant_report(tenant=tenant, start=start, end=end, usage=window)
    report = full_report.as_dict()
    quota = quota_get(tenant=tenant)
    usage = quota_usage(tenant=tenant, spent=full_report.month_cost, quota=quota)
    month = report["month_to_date"]
    budget = Decimal(month["budget"]) if month["budget"] else None
    spent = Decimal(month["cost"])
    concurrency = peak_concurrency(tenant=tenant, start=start, end=end, now=now)
    alert = quota.budget_alert
    return {
        "nav_section": "usage",
        "report": report,
        "error": error,
        "start": start.date().isoformat(),
        "end": window_end_date(end),
        "bars": quota_bars(usage),
        "budget": budget,
        "spent": spent,
        "budget_percent": min(100, round(100 * spent / budget)) if budget else 0,
        "cost_chart": _chart(report["days"], "cost_exact", "Cost (USD)", " $"),
        "hours_chart": _chart(report["days"], "sandbox_hours", "Sandbox-hours", " h"),
        "concurrency": concurrency,
        "concurrency_chart": {
            "labels": [d["day"][5:] for d in concurrency],
            "datasets": [{"label": "Peak concurrent", "data": [d["peak"] for d in concurrency]}],
            "unit": "",
        },
        # Images and labels are different slicings of the same cost (a sandbox has
        # one image and several labels): one chart each, never one axis mixing both.
        "image_chart": _slice_chart(report["by_image"], "image"),
        "label_chart": _slice_chart(report["by_label"], "label"),
        "by_key": cost_by_key_of(tenant, window),
        "budget_alert": alert,
        "alert_reached": alert is not None and spent >= alert,
        "team_budget": quota.team_budget,
        "team_budget_reached": quota.team_budget is not None and spent >= quota.team_budget,
        "webhook_set": bool(quota.alert_webhook_url),
        "notices": notices_current(tenant=tenant, spent=full_report.month_cost),
        "form_values": {
            "budget_alert": "" if alert is None else f"{alert:.2f}",
            "team_budget": "" if quota.team_budget is None else f"{quota.team_budget:.2f}",
            "alert_webhook_url": "",
        },
        "form_errors": {},
    }


def _slice_chart(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {
        "labels": [r[key] for r in rows],
        "datasets": [
            {"label": "Cost (USD)", "data": [float(Decimal(r["cost_exact"])) for r in rows]}
        ],
        "unit": " $",
    }


@staff_page
@require_GET
def cost_report_page(request: HttpRequest) -> HttpResponse:
    start, end, error = _window(request)
    sort = request.GET.get("sort", "-cost")
    rows = cost_report(start=start, end=end, sort=sort)
    if request.GET.get("output") == "csv":
        return cost_report_csv(rows, start=start, end=end)
    total = sum((r["cost"] for r in rows), Decimal(0))
    columns = [
        {
            "key": c,
            "label": c.replace("_", " "),
            "sort": f"-{c}" if sort != f"-{c}" else c,
            "active": sort.lstrip("-") == c,
            "descending": sort.startswith("-"),
        }
        for c in COST_REPORT_COLUMNS
    ]
    return render(
        request,
        "billing/cost_report.html",
        {
            "rows": rows,
            "columns": columns,
            "sort": sort,
            "start": start.date().isoformat(),
            "end": window_end_date(end),
            "error": error,
            "total": total,
            "price_book": current_price_book(),
        },
    )
