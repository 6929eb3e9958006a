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
            "last_used_from",
            "rotated_at",
            "previous_valid_until",
        ]


class ApiKeyCreateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=200)
    scopes = serializers.ListField(child=serializers.CharField(), required=False)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)


class ApiKeyRenameSerializer(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=200)


class ApiKeyRotateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    grace_seconds = serializers.IntegerField(required=False, min_value=0)


class ActivitySerializer(serializers.Serializer):  # type: ignore[type-arg]
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    actor = serializers.CharField()
    action = serializers.CharField()
    target_type = serializers.CharField()
    target_id = serializers.CharField()
    target_name = serializers.CharField()
    details = serializers.DictField()
