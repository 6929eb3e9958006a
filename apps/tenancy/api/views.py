from __future__ import annotations

from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.tenancy import activity, selectors, services
from apps.tenancy.api.serializers import (
    ActivitySerializer,
    ApiKeyCreateSerializer,
    ApiKeyRenameSerializer,
    ApiKeyRotateSerializer,
    ApiKeySerializer,
)
from apps.tenancy.models import Activity
from apps.tenancy.permissions import principal_of


class ApiKeyListCreateView(APIView):
    required_scope = "admin"

    @extend_schema(responses={200: ApiKeySerializer(many=True)})
    def get(self, request: Request) -> Response:
        keys = selectors.api_key_list(tenant=principal_of(request).tenant)
        return Response({"results": ApiKeySerializer(keys, many=True).data})

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeySerializer})
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        serializer = ApiKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = services.api_key_create(
            tenant=principal.tenant,
            name=serializer.validated_data["name"],
            scopes=serializer.validated_data.get("scopes"),
            expires_at=serializer.validated_data.get("expires_at"),
            created_by=principal.user,
            granted_by=principal.scopes,
            actor=principal.actor,
        )
        body = {**ApiKeySerializer(issued.key).data, "secret": issued.secret}
        return Response(body, status=status.HTTP_201_CREATED)


class ApiKeyDetailView(APIView):
    required_scope = "admin"

    @extend_schema(
        request=ApiKeyRenameSerializer,
        responses={200: ApiKeySerializer},
        description="Renames a key; its secret, prefix and scopes stay.",
    )
    def patch(self, request: Request, key_id: str) -> Response:
        principal = principal_of(request)
        key = selectors.api_key_get(tenant=principal.tenant, key_id=key_id)
        serializer = ApiKeyRenameSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = services.api_key_rename(
            key=key, name=serializer.validated_data["name"], actor=principal.actor
        )
        return Response(ApiKeySerializer(key).data)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    def delete(self, request: Request, key_id: str) -> Response:
        principal = principal_of(request)
        key = selectors.api_key_get(tenant=principal.tenant, key_id=key_id)
        return Response(
            ApiKeySerializer(services.api_key_revoke(key=key, actor=principal.actor)).data
        )


class ApiKeyRotateView(APIView):
    required_scope = "admin"

    @extend_schema(
        request=ApiKeyRotateSerializer,
        responses={200: ApiKeySerializer},
        description="Gives the key a new secret (in `secret`, shown once). The old secret "
        "keeps working for `grace_seconds` (default HEDGEROW_KEY_ROTATION_GRACE_S; 0: "
        "refused at once) until `previous_valid_until`, then is refused. A revoked or "
        "expired key is a 409.",
    )
    def post(self, request: Request, key_id: str) -> Response:
        principal = principal_of(request)
        key = selectors.api_key_get(tenant=principal.tenant, key_id=key_id)
        serializer = ApiKeyRotateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = services.api_key_rotate(
            key=key,
            actor=principal.actor,
            grace_seconds=serializer.validated_data.get("grace_seconds"),
        )
        return Response({**ApiKeySerializer(issued.key).data, "secret": issued.secret})


_FILTERS = [
    OpenApiParameter("action", str, description="one action, e.g. key.rotated"),
    OpenApiParameter("actor", str, description="e.g. user:maya or key:hr_AbCdEfGh"),
    OpenApiParameter("since", str, description="ISO 8601 time, inclusive"),
    OpenApiParameter("until", str, description="ISO 8601 time, exclusive"),
]


def _filtered(request: Request) -> QuerySet[Activity]:
    params = request.query_params
    return activity.activity_list(
        tenant=principal_of(request).tenant,
        action=params.get("action"),
        actor=params.get("actor"),
        since=activity.parse_instant(params.get("since"), field="since"),
        until=activity.parse_instant(params.get("until"), field="until"),
    )


class ActivityListView(APIView):
    """The team's activity log (who did what to keys, members, sandboxes and limits).
    Admin scope: it names every member's actions."""

    required_scope = "admin"

    @extend_schema(
        parameters=[
            *_FILTERS,
            OpenApiParameter("limit", int, description="page size, 1-500 (default 50)"),
            OpenApiParameter("cursor", str, description="next_cursor of the previous page"),
        ],
        responses={200: ActivitySerializer(many=True)},
        description="Newest first, one keyset page at a time: `results` and `next_cursor` "
        "(null on the last page). Entries are kept HEDGEROW_ACTIVITY_RETENTION_DAYS.",
    )
    def get(self, request: Request) -> Response:
        page = activity.activity_page(
            _filtered(request),
            cursor=request.query_params.get("cursor"),
            limit=activity.page_limit(request.query_params.get("limit")),
        )
        return Response(
            {
                "results": [activity.activity_as_dict(entry) for entry in page.rows],
                "next_cursor": page.next_cursor,
            }
        )


class ActivityExportView(APIView):
    required_scope = "admin"

    @extend_schema(
        parameters=[
            *_FILTERS,
            OpenApiParameter("output", str, description="csv (default) or jsonl"),
        ],
        responses={(200, "text/csv"): bytes, (200, "application/x-ndjson"): bytes},
        description="Every matching entry, streamed, newest first: the list's fields "
        "(`details` as JSON in CSV). Never contains a secret.",
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        fmt = request.query_params.get("output") or "csv"
        rows = activity.activity_export(_filtered(request), fmt=fmt)  # 400 before streaming
        content_type = "text/csv" if fmt == "csv" else "application/x-ndjson"
        response = StreamingHttpResponse(rows, content_type=f"{content_type}; charset=utf-8")
        stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
        response["Content-Disposition"] = (
            f'attachment; filename="activity-{principal_of(request).tenant.slug}-{stamp}.{fmt}"'
        )
        return response
