"""A tenant's own leak audits over the API: history, one audit, and an audit of its
slice, run by a worker (``POST`` answers 202 with the ``running`` row)."""

from __future__ import annotations

from datetime import datetime

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import NotFound, ValidationFailed
from apps.core.keyset import API_PAGE_MAX, CURSOR_DOCS, api_keyset_page
from apps.sandboxes import reports
from apps.sandboxes.models import AuditRun
from apps.sandboxes.services.audit import audit_request
from apps.tenancy.permissions import principal_of


def _when(request: Request, name: str) -> datetime | None:
    raw = request.data.get(name) if hasattr(request.data, "get") else None
    if raw in (None, ""):
        return None
    value = parse_datetime(str(raw))
    if value is None:
        raise ValidationFailed(f"{name} must be an ISO 8601 datetime", field=name)
    return value


class AuditListView(APIView):
    @extend_schema(
        operation_id="v1_audits_list",
        responses={200: dict},
        parameters=CURSOR_DOCS,
        description="This tenant's stored leak audits, newest first (scheduled and manual), "
        f"{reports.HISTORY} a page by default (`limit` 1–{API_PAGE_MAX}); `next_cursor` "
        "(null on the last page) is the `cursor` of the next page.",
    )
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        rows, next_cursor = api_keyset_page(
            reports.audit_runs(tenant=principal.tenant),
            cursor=request.query_params.get("cursor", ""),
            limit=request.query_params.get("limit"),
            default=reports.HISTORY,
        )
        return Response(
            {"results": [reports.audit_row(run) for run in rows], "next_cursor": next_cursor}
        )

    @extend_schema(
        request=None,
        responses={202: dict, 429: dict},
        parameters=[
            OpenApiParameter("period_start", str, description="ISO 8601; default now - 24h"),
            OpenApiParameter("period_end", str, description="ISO 8601; default now"),
            OpenApiParameter("image", str),
        ],
        description="Audits this tenant's sandboxes created in the period and stores the "
        "result: created = deleted + reaped_ttl + reaped_heartbeat + failed + lost + live "
        "+ leaked, with the ids behind any imbalance. A worker computes it: the answer is "
        "202 with the audit `running` and a Location to poll (GET /api/v1/audits/{id} "
        "until `status` is `done` or `failed`). One at a time per team and at most one "
        "per HEDGEROW_AUDIT_MIN_INTERVAL_S: else 429 `audit_in_progress` / "
        "`audit_throttled` with Retry-After. Never reclaims (operators do).",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        image = request.data.get("image", "") if hasattr(request.data, "get") else ""
        run = audit_request(
            tenant=principal.tenant,
            period_start=_when(request, "period_start"),
            period_end=_when(request, "period_end"),
            image=str(image or ""),
        )
        return Response(
            reports.audit_row(run),
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": f"/api/v1/audits/{run.pk}"},
        )


class AuditDetailView(APIView):
    @extend_schema(responses={200: dict}, description="One of this tenant's audits.")
    def get(self, request: Request, audit_id: int) -> Response:
        principal = principal_of(request)
        run = AuditRun.objects.filter(pk=audit_id, tenant=principal.tenant).first()
        if run is None:
            raise NotFound(f"no audit {audit_id}")
        return Response(reports.audit_row(run))
