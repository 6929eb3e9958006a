"""``GET /api/v1/version``: the server's version and the SDK releases it supports."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.version import version_info


class VersionView(APIView):
    """Public (no key): clients check compatibility before they authenticate."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        auth=[],
        responses={
            200: inline_serializer(
                "Version",
                {
                    "version": serializers.CharField(),
                    "api": serializers.CharField(),
                    "sdk": serializers.DictField(child=serializers.CharField()),
                },
            )
        },
        description="The server's version, its API version and the SDK releases it "
        "supports (`sdk.minimum` … `sdk.current`).",
    )
    def get(self, request: Request) -> Response:
        return Response(version_info())
