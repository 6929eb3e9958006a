from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.tenancy import selectors, services
from apps.tenancy.api.serializers import ApiKeyCreateSerializer, ApiKeySerializer
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
        )
        body = {**ApiKeySerializer(issued.key).data, "secret": issued.secret}
        return Response(body, status=status.HTTP_201_CREATED)


class ApiKeyDetailView(APIView):
    required_scope = "admin"

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    def delete(self, request: Request, key_id: str) -> Response:
        key = selectors.api_key_get(tenant=principal_of(request).tenant, key_id=key_id)
        return Response(ApiKeySerializer(services.api_key_revoke(key=key)).data)
