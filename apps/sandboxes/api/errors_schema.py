"""The error envelope, documented once for every endpoint's OpenAPI responses."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers

ErrorSerializer = inline_serializer(
    name="Error",
    fields={
        "error": inline_serializer(
            name="ErrorBody",
            fields={
                "code": serializers.CharField(help_text="stable machine-readable code"),
                "message": serializers.CharField(),
                "field": serializers.CharField(allow_null=True),
            },
        )
    },
)

ERROR_RESPONSES = {
    400: OpenApiResponse(ErrorSerializer, description="invalid input (validation_error, …)"),
    401: OpenApiResponse(ErrorSerializer, description="missing, unknown, revoked or expired key"),
    403: OpenApiResponse(ErrorSerializer, description="the key lacks the needed scope"),
    404: OpenApiResponse(ErrorSerializer, description="no such object in your team"),
    409: OpenApiResponse(
        ErrorSerializer, description="state conflict (not ready, stale generation, reused id)"
    ),
    413: OpenApiResponse(ErrorSerializer, description="too large"),
    429: OpenApiResponse(ErrorSerializer, description="quota or rate limit; see Retry-After"),
    502: OpenApiResponse(ErrorSerializer, description="the sandbox's agent did not answer"),
}
