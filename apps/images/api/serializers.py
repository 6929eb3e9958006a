from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.images.models import Image, RegistryCredential


class ImageProgressSerializer(serializers.Serializer):  # type: ignore[type-arg]
    phase = serializers.CharField()
    layers = serializers.IntegerField()
    bytes = serializers.IntegerField()
    total = serializers.IntegerField()


class ImageErrorSerializer(serializers.Serializer):  # type: ignore[type-arg]
    code = serializers.CharField()
    message = serializers.CharField()


class ImageSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    progress = ImageProgressSerializer(allow_null=True, read_only=True)
    error = serializers.SerializerMethodField()
    sandboxes = serializers.SerializerMethodField(help_text="live sandboxes running it")

    class Meta:
        model = Image
        fields = [
            "id",
            "reference",
            "digest",
            "status",
            "size_bytes",
            "layers",
            "progress",
            "error",
            "sandboxes",
            "last_used_at",
            "created_at",
            "private",
        ]
        read_only_fields = fields

    def get_error(self, obj: Image) -> dict[str, str] | None:
        if not obj.error_code:
            return None
        return {"code": obj.error_code, "message": obj.error_message}

    def get_sandboxes(self, obj: Image) -> int:
        return int(getattr(obj, "live_sandboxes", 0) or 0)


class ImagePullSerializer(serializers.Serializer):  # type: ignore[type-arg]
    reference = serializers.CharField(
        max_length=512, help_text="an OCI reference: python:3.12-slim, ghcr.io/org/img@sha256:…"
    )


class ImageImportSerializer(serializers.Serializer):  # type: ignore[type-arg]
    file = serializers.FileField(help_text="an OCI layout tarball or a `docker save` tarball")
    reference = serializers.CharField(max_length=512)


class RegistryCredentialSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = RegistryCredential
        fields = ["id", "registry", "username", "created_at"]
        read_only_fields = fields


class RegistryCredentialCreateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    registry = serializers.CharField(max_length=255, help_text="host[:port], e.g. ghcr.io")
    username = serializers.CharField(max_length=255)
    password = serializers.CharField(
        max_length=4096, write_only=True, help_text="encrypted at rest; never returned"
    )

    def to_representation(self, instance: Any) -> dict[str, Any]:  # never echo it
        return {}
