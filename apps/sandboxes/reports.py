"""Read side of the leak report: stored audits and reconciler rounds, shaped for pages
and JSON. Selectors only — nothing here writes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from apps.sandboxes.models import AuditRun, AuditStatus, ReconcileRun, Sandbox, SandboxEvent
from apps.sandboxes.services.audit import AUDIT_STALE_S, TERMS
from apps.tenancy.models import Tenant

HISTORY = 50


def audit_history(*, tenant: Tenant | None, limit: int = HISTORY) -> list[AuditRun]:
    """Stored audits, newest first: installation-wide ones (tenant None) or a tenant's."""
    return list(audit_runs(tenant=tenant).order_by("-created_at", "-id")[:limit])


def audit_runs(*, tenant: Tenant | None) -> QuerySet[AuditRun]:
    """Every stored audit of the installation (tenant None: not the per-image, per-node
    or per-backend slices) or of a tenant, unordered."""
    qs = AuditRun.objects.filter(tenant=tenant)
    if tenant is None:
        qs = qs.filter(image="", node="", backend="")
    return qs


def audit_row(run: AuditRun) -> dict[str, Any]:
    return {
        "id": run.id,
        "status": run.status,  # running (a team's audit in its worker), done, failed
        "error": run.error or None,
        "created_at": run.created_at.isoformat(),
        "trigger": run.trigger,
        "period_start": run.period_start.isoformat(),
        "period_end": run.period_end.isoformat(),
        "tenant": run.tenant.slug if run.tenant else None,
        "created": run.created,
        **{term: getattr(run, term) for term in TERMS},
        "orphaned": run.orphaned,
        "reclaimed": run.reclaimed,
        "balanced": run.balanced,
        "ttl_share": run.ttl_share,
        "equation": run.report.get("equation", ""),
        "warnings": run.report.get("warnings", []),
        "imbalance": run.report.get("imbalance", {}),
        "leaked_ids": run.report.get("leaked_ids", []),
        "orphaned_ids": run.report.get("orphaned", []),
        "residual_by_kind": run.report.get("residual_by_kind", {}),
        "reasons": run.report.get("reasons", {}),
    }


def _terms(latest: dict[str, Any] | None) -> list[tuple[str, int]]:
    return [(term, latest[term]) for term in ("created", *TERMS)] if latest else []


def _tenant(slug: str) -> Tenant | None:
    return Tenant.objects.filter(slug=slug).first() if slug else None


def leak_report_context(*, tenant_slug: str = "") -> dict[str, Any]:
    tenant = _tenant(tenant_slug)
    runs = audit_history(tenant=tenant)
    fresh = timezone.now() - timedelta(seconds=AUDIT_STALE_S)  # older: its worker died
    pending = next(
        (r for r in runs if r.status == AuditStatus.RUNNING and r.created_at >= fresh), None
    )
    history = [r for r in runs if r.status != AuditStatus.RUNNING]
    latest = history[0] if history else None
    recent_reclaims = (
        SandboxEvent.objects.filter(event="leak_reclaimed")
        .select_related("sandbox", "tenant")
        .order_by("-at", "-id")[:20]
    )
    latest_row = audit_row(latest) if latest else None
    return {
        "tenant": tenant,
        "tenants": Tenant.objects.order_by("slug"),
        "latest": latest_row,
        "latest_terms": _terms(latest_row),
        "pending": audit_row(pending) if pending else None,  # asked, not computed yet
        "history": [audit_row(run) for run in history],
        "rounds": list(ReconcileRun.objects.order_by("-started_at", "-id")[:10]),
        "reclaims": list(recent_reclaims),
    }


def leak_report_json(*, tenant_slug: str = "") -> dict[str, Any]:
    tenant = _tenant(tenant_slug)
    return {
        "tenant": tenant.slug if tenant else None,
        "results": [audit_row(run) for run in audit_history(tenant=tenant)],
        "reconcile_rounds": [
            {
                "started_at": r.started_at.isoformat(),
                "skipped": r.skipped,
                "skip_reason": r.skip_reason,
                "inventory_items": r.inventory_items,
                "actions": r.actions,
            }
            for r in ReconcileRun.objects.order_by("-started_at", "-id")[:10]
        ],
    }


def tenant_leaks_context(*, tenant: Tenant) -> dict[str, Any]:
    history = audit_history(tenant=tenant)
    reclaims = (
        SandboxEvent.objects.filter(tenant=tenant, event="leak_reclaimed")
        .select_related("sandbox")
        .order_by("-at", "-id")[:20]
    )
    latest_row = audit_row(history[0]) if history else None
    return {
        "tenant": tenant,
        "latest": latest_row,
        "latest_terms": _terms(latest_row),
        "history": [audit_row(run) for run in history],
        "reclaims": list(reclaims),
        "live": Sandbox.objects.for_tenant(tenant)
        .filter(state__in=("requested", "provisioning", "ready", "terminating"))
        .count(),
    }
