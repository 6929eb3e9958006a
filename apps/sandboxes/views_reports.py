"""Operator-facing pages and endpoints: /metrics, the leak report (staff) and a
tenant's own leak history. Views only call services and selectors."""

from __future__ import annotations

import hmac
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from apps.sandboxes import reports
from apps.sandboxes.metrics import render_metrics
from apps.sandboxes.services.audit import audit_request_installation
from apps.tenancy.pages import page, render_page, staff_page
from apps.tenancy.principal import Principal

CONTENT_TYPE_LATEST = "text/plain; version=0.0.4; charset=utf-8"


def _token_ok(request: HttpRequest) -> bool:
    expected = settings.HEDGEROW_METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if not expected or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header.removeprefix("Bearer ").encode(), expected.encode())


def _is_staff(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus scrape target: a staff session or ``Bearer HEDGEROW_METRICS_TOKEN``."""
    if not (_token_ok(request) or _is_staff(request)):
        return HttpResponse("metrics need a staff session or the metrics token\n", status=401)
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE_LATEST)


@staff_page
@require_http_methods(["GET"])
def leak_report(request: HttpRequest) -> HttpResponse:
    context: dict[str, Any] = reports.leak_report_context(tenant_slug=request.GET.get("tenant", ""))
    return render(request, "reports/leak_report.html", context)


@staff_page
@require_POST
def leak_report_run(request: HttpRequest) -> HttpResponse:
    """Asks a worker for a reconciler round (if asked) and an installation-wide audit
    now; the page shows it running, then its result."""
    audit_request_installation(
        reconcile=bool(request.POST.get("reconcile")), reclaim=bool(request.POST.get("reclaim"))
    )
    return redirect("leak-report")


def leak_report_json(request: HttpRequest) -> HttpResponse:
    """The leak report for machines: staff session or the metrics token."""
    if not (_token_ok(request) or _is_staff(request)):
        return JsonResponse({"error": {"code": "forbidden", "message": "staff only"}}, status=403)
    return JsonResponse(reports.leak_report_json(tenant_slug=request.GET.get("tenant", "")))


@require_http_methods(["GET"])
@page("read")
def tenant_leaks(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The dashboard page of the session's team: its audits over time, reclaimed leaks."""
    context = reports.tenant_leaks_context(tenant=principal.tenant)
    return render_page(
        request, principal, "reports/tenant_leaks.html", {**context, "nav_section": "leaks"}
    )
