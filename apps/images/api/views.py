from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import ApiError
from apps.core.keyset import api_keyset_page
from apps.images import services
from apps.images.api.serializers import (
    ImageImportSerializer,
    ImagePullSerializer,
    ImageSerializer,
    RegistryCredentialCreateSerializer,
    RegistryCredentialSerializer,
)
from apps.images.models import Image, ImageStatus
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES, ErrorSerializer
from apps.tenancy.permissions import principal_of

IMAGE_ERRORS = {
    **ERROR_RESPONSES,
    422: OpenApiResponse(
        ErrorSerializer,
        description="the image cannot be had: image_not_found, registry_unauthorized, "
        "registry_unreachable, registry_forbidden, image_digest_mismatch, "
        "image_platform_unsupported, "
        "image_layer_refused, image_archive_invalid, … (docs/images.md)",
    ),
    507: OpenApiResponse(ErrorSerializer, description="disk_exhausted"),
}


def _render(image: Image) -> dict[str, Any]:
    return dict(ImageSerializer(image).data)


def _bool_param(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes")


class ImageListCreateView(APIView):
    @extend_schema(
        responses={200: ImageSerializer(many=True)},
        parameters=[
            OpenApiParameter(
                "cursor",
                str,
                description="keyset paging: empty for the first page, then next_cursor "
                "(results + next_cursor, no count); without it, limit/offset pages",
            )
        ],
    )
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        qs = services.image_list(tenant=principal.tenant)
        if "cursor" in request.query_params:
            rows, next_cursor = api_keyset_page(
                qs,
                cursor=request.query_params.get("cursor", ""),
                limit=request.query_params.get("limit"),
            )
            data = ImageSerializer(rows, many=True).data
            return Response({"results": data, "next_cursor": next_cursor})
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(ImageSerializer(page, many=True).data)

    @extend_schema(
        request=ImagePullSerializer,
        responses={202: ImageSerializer, 200: ImageSerializer, **IMAGE_ERRORS},
        parameters=[
            OpenApiParameter("wait", bool, description="block until the pull ends (bounded)"),
            OpenApiParameter("timeout", float, description="seconds for wait, ≤ 600"),
        ],
        description="Proves access to the image now (its manifest, with your stored "
        "credentials for its registry: a typed 4xx otherwise, nothing recorded) and pulls "
        "it in a worker (202, status `pulling`). One pull per (team, reference) in flight: "
        "a second POST returns the same record. `?wait=true` answers 200 once it is "
        "`ready` or `failed` (or 202 still `pulling` after the timeout).",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        body = ImagePullSerializer(data=request.data)
        if not body.is_valid():
            services.normalise_reference(request.data.get("reference"))  # typed 400
            body.is_valid(raise_exception=True)
        image, _ = services.image_pull_request(
            tenant=principal.tenant, reference=body.validated_data["reference"]
        )
        if _bool_param(request, "wait"):
            try:
                timeout = float(request.query_params.get("timeout", 300))
            except ValueError:
                raise ApiError("timeout must be a number", field="timeout") from None
            image = services.image_wait(image=image, timeout_s=timeout)
        image = services.image_get(tenant=principal.tenant, image_id=str(image.pk))
        done = image.status != ImageStatus.PULLING
        return Response(
            _render(image), status=status.HTTP_200_OK if done else status.HTTP_202_ACCEPTED
        )


class ImageDetailView(APIView):
    @extend_schema(responses={200: ImageSerializer, **ERROR_RESPONSES})
    def get(self, request: Request, image_id: str) -> Response:
        principal = principal_of(request)
        return Response(_render(services.image_get(tenant=principal.tenant, image_id=image_id)))

    @extend_schema(
        responses={204: None, **ERROR_RESPONSES},
        description="Forgets the image (409 `image_in_use` while a live sandbox runs it).",
    )
    def delete(self, request: Request, image_id: str) -> Response:
        principal = principal_of(request)
        image = services.image_get(tenant=principal.tenant, image_id=image_id)
        services.image_delete(tenant=principal.tenant, image=image)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ImageImportView(APIView):
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(
        request={"multipart/form-data": ImageImportSerializer},
        responses={201: ImageSerializer, **IMAGE_ERRORS},
        description="Uploads an OCI layout tarball or a `docker save` tarball as "
        "`reference` (status `ready` at once).",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        body = ImageImportSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        image = services.image_import(
            tenant=principal.tenant,
            reference=body.validated_data["reference"],
            upload=body.validated_data["file"],
        )
        return Response(_render(image), status=status.HTTP_201_CREATED)


class RegistryCredentialListCreateView(APIView):
    @extend_schema(responses={200: RegistryCredentialSerializer(many=True)})
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        from apps.images.models import RegistryCredential

        qs = RegistryCredential.objects.for_tenant(principal.tenant)
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(RegistryCredentialSerializer(page, many=True).data)

    @extend_schema(
        request=RegistryCredentialCreateSerializer,
        responses={201: RegistryCredentialSerializer, **ERROR_RESPONSES},
        description="Stores your login for a registry (one per registry host: a second "
        "POST replaces it). The password is encrypted at rest and never returned.",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        body = RegistryCredentialCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        cred = services.credential_create(
            tenant=principal.tenant,
            registry=body.validated_data["registry"],
            username=body.validated_data["username"],
            password=body.validated_data["password"],
        )
        return Response(RegistryCredentialSerializer(cred).data, status=status.HTTP_201_CREATED)


class RegistryCredentialDetailView(APIView):
    @extend_schema(responses={200: RegistryCredentialSerializer, **ERROR_RESPONSES})
    def get(self, request: Request, credential_id: str) -> Response:
        principal = principal_of(request)
        cred = services.credential_get(tenant=principal.tenant, credential_id=credential_id)
        return Response(RegistryCredentialSerializer(cred).data)

    @extend_schema(responses={204: None, **ERROR_RESPONSES})
    def delete(self, request: Request, credential_id: str) -> Response:
        principal = principal_of(request)
        cred = services.credential_get(tenant=principal.tenant, credential_id=credential_id)
        services.credential_delete(credential=cred)
        return Response(status=status.HTTP_204_NO_CONTENT)
