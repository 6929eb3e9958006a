"""A tenant's own leak audits over the API: history, and an audit of its slice now."""

from __future__ import annotations

from datetime import datetime

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import ValidationFailed
from apps.sandboxes import reports
from apps.sandboxes.services.audit import AuditSlice, audit_run
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
        responses={200: dict},
        description="This tenant's stored leak audits, newest first (scheduled and manual).",
    )
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        history = reports.audit_history(tenant=principal.tenant)
        return Response({"results": [reports.audit_row(run) for run in history]})

    @extend_schema(
        request=None,
        responses={201: dict},
        parameters=[
            OpenApiParameter("period_start", str, description="ISO 8601; default now - 24h"),
            OpenApiParameter("period_end", str, description="ISO 8601; default now"),
            OpenApiParameter("image", str),
        ],
        description="Audits this tenant's sandboxes created in the period now and stores "
        "the result: created = deleted + reaped_ttl + reaped_heartbeat + failed + lost + "
        "live + leaked, with the ids behind any imbalance. Never reclaims (operators do).",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        image = request.data.get("image", "") if hasattr(request.data, "get") else ""
        run = audit_run(
            period_start=_when(request, "period_start"),
            period_end=_when(request, "period_end"),
            audit_slice=AuditSlice(tenant=principal.tenant, image=str(image or "")),
        )
        return Response(reports.audit_row(run), status=status.HTTP_201_CREATED)
