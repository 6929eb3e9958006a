from __future__ import annotations

from rest_framework import serializers

from apps.tenancy.models import ApiKey


class ApiKeySerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
        ]


class ApiKeyCreateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=200)
    scopes = serializers.ListField(child=serializers.CharField(), required=False)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
