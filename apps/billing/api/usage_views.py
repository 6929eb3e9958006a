"""Quota, usage and price-book endpoints for tenants; quota and cost report for staff."""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, timedelta

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.billing import services
from apps.billing.api.serializers import PriceBookSerializer, TenantQuotaSerializer
from apps.billing.models import PriceBook
from apps.billing.notices import notices_current
from apps.billing.pricing import money
from apps.billing.quotas import quota_get, quota_usage
from apps.billing.reports import (
    COST_REPORT_COLUMNS,
    cost_report,
    month_to_date_cost,
    tenant_report,
    window_usage,
)
from apps.core.errors import ApiError, NotFound, ValidationFailed
from apps.tenancy.models import Tenant
from apps.tenancy.permissions import principal_of

WINDOW_PARAMS = [
    OpenApiParameter("start", str, description="ISO date/time (default: 30 days ago)"),
    OpenApiParameter(
        "end",
        str,
        description="ISO date (inclusive: through the end of that day, UTC) or date/time "
        "(exclusive); default: now",
    ),
]


def parse_window(
    params: dict[str, str] | None, *, now: datetime | None = None
) -> tuple[datetime, datetime]:
    """[start, end) from ISO dates or datetimes (UTC when naive); ≤ 400 days.

    The one window rule of the API, the pages, their sorting and CSV: a bare *date* as
    ``end`` is inclusive (through the end of that day), so "to 2026-12-02" includes
    today and start = end is a single day; a datetime is an exact, exclusive bound."""
    params = params or {}
    now = now or timezone.now()

    def parse(name: str, default: datetime) -> datetime:
        raw = (params.get(name) or "").strip()
        if not raw:
            return default
        try:
            value = datetime.fromisoformat(raw)
        except ValueError:
            raise ValidationFailed(f"{name} must be an ISO date or datetime", field=name) from None
        if name == "end" and _is_date(raw):
            value += timedelta(days=1)
        return value if value.tzinfo else value.replace(tzinfo=UTC)

    end = parse("end", now)
    # from midnight (to the microsecond: a first day cut short by a fraction of a
    # second is not a whole day, and would be read from the records, not the roll-up)
    start = parse(
        "start", (end - timedelta(days=30)).replace(hour=0, minute=0, second=0, microsecond=0)
    )
    if start >= end:
        raise ValidationFailed("start must be before end", field="start")
    if end - start > timedelta(days=400):
        raise ValidationFailed("at most 400 days per report", field="start")
    return start, end


def _is_date(raw: str) -> bool:
    try:
        date.fromisoformat(raw)
    except ValueError:
        return False
    return "T" not in raw and " " not in raw and ":" not in raw


def window_end_date(end: datetime) -> str:
    """The inclusive end date a page shows (and links back with) for ``end``."""
    return (end - timedelta(microseconds=1)).date().isoformat()


class QuotaView(APIView):
    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        """This team's limits next to its current use (null limit = unlimited)."""
        return Response(quota_usage(tenant=principal_of(request).tenant))


def budget_settings(*, tenant: Tenant) -> dict[str, object]:
    """The team's budgets, alert and month-to-date spend; the webhook only as set or not
    (its URL may carry a token)."""
    quota = quota_get(tenant=tenant)
    spent = month_to_date_cost(tenant=tenant)

    def text(value: object) -> str | None:
        return None if value is None else str(value)

    return {
        "team_budget": text(quota.team_budget),
        "budget_alert": text(quota.budget_alert),
        "monthly_budget": text(quota.monthly_budget),
        "month_to_date": str(money(spent)),
        "alert_webhook_set": bool(quota.alert_webhook_url),
        "notices": notices_current(tenant=tenant),
    }


class BudgetView(APIView):
    """``GET``: any key that can read. ``PATCH``: admin scope (owners and admins)."""

    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        """The team's own hard budget, its alert, staff's budget and this month's spend."""
        return Response(budget_settings(tenant=principal_of(request).tenant))

    @extend_schema(request=dict, responses={200: dict})
    def patch(self, request: Request) -> Response:
        """Sets any of ``team_budget`` and ``budget_alert`` (USD strings, cents at most;
        null clears) and ``alert_webhook_url`` (http/https; "" or null removes it).
        One bad field: 400 naming it, nothing changed."""
        principal = principal_of(request)
        if not principal.has_scope("admin"):
            raise ApiError(
                "setting the team's budget, alert or webhook needs the admin scope "
                "(an owner or admin)",
                code="permission_denied",
                status_code=403,
            )
        if not isinstance(request.data, dict):
            raise ValidationFailed("expected a JSON object", field=None)
        services.owner_settings_update(
            quota=quota_get(tenant=principal.tenant),
            values=dict(request.data),
            actor=principal.actor,
        )
        return Response(budget_settings(tenant=principal.tenant))


class UsageView(APIView):
    @extend_schema(parameters=WINDOW_PARAMS, responses={200: dict})
    def get(self, request: Request) -> Response:
        """Usage and cost per day, image and label, the month against the budget, and
        what the same usage costs at hosted list prices. Money: decimal strings (USD)."""
        now = timezone.now()
        start, end = parse_window(request.query_params.dict(), now=now)
        tenant = principal_of(request).tenant
        # one clock for the window and the month to date, so the month is read from the
        # window's days when the window holds it (``month_cost_within``)
        usage = window_usage(tenant=tenant, start=start, end=end, now=now)
        return Response(tenant_report(tenant=tenant, start=start, end=end, usage=usage).as_dict())


class PriceBookListView(APIView):
    @extend_schema(responses={200: PriceBookSerializer(many=True)})
    def get(self, request: Request) -> Response:
        books = PriceBook.objects.prefetch_related("rates").order_by("slug", "-version")
        return Response({"results": PriceBookSerializer(books, many=True).data})


class StaffView(APIView):
    """Staff only: a Django staff session (the admin's login)."""

    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAdminUser]


class AdminTenantQuotaView(StaffView):
    def _tenant(self, slug: str) -> Tenant:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise NotFound(f"no tenant {slug!r}", code="tenant_not_found")
        return tenant

    @extend_schema(responses={200: TenantQuotaSerializer})
    def get(self, request: Request, slug: str) -> Response:
        return Response(TenantQuotaSerializer(quota_get(tenant=self._tenant(slug))).data)

    @extend_schema(request=TenantQuotaSerializer, responses={200: TenantQuotaSerializer})
    def patch(self, request: Request, slug: str) -> Response:
        quota = quota_get(tenant=self._tenant(slug))
        serializer = TenantQuotaSerializer(quota, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        quota = services.quota_update(
            quota=quota,
            changes=dict(serializer.validated_data),
            actor=f"staff:{request.user.get_username()}",
        )
        return Response(TenantQuotaSerializer(quota).data)


class AdminCostReportView(StaffView):
    @extend_schema(
        parameters=[
            *WINDOW_PARAMS,
            OpenApiParameter("sort", str, description="a column, '-' for descending"),
            OpenApiParameter("output", str, description="json (default) or csv"),
        ],
        responses={200: dict},
    )
    def get(self, request: Request) -> Response | HttpResponse:
        start, end = parse_window(request.query_params.dict())
        rows = cost_report(start=start, end=end, sort=request.query_params.get("sort", "-cost"))
        if request.query_params.get("output") == "csv":
            return cost_report_csv(rows, start=start, end=end)
        return Response(
            {
                "start": start.isoformat(),
                "end": end.isoformat(),
                "results": [{k: str(v) for k, v in row.items()} for row in rows],
            }
        )


def cost_report_csv(
    rows: list[dict[str, object]], *, start: datetime, end: datetime
) -> HttpResponse:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COST_REPORT_COLUMNS)
    for row in rows:
        writer.writerow([row[c] for c in COST_REPORT_COLUMNS])
    response = HttpResponse(buffer.getvalue(), content_type="text/csv; charset=utf-8")
    name = f"hedgerow-costs-{start.date().isoformat()}-{end.date().isoformat()}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response
