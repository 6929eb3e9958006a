"""A tenant's images (pulled or imported OCI images) and registry credentials."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone

from apps.tenancy.models import Tenant


class RegistryCredentialQuerySet(models.QuerySet["RegistryCredential"]):
    def for_tenant(self, tenant: Tenant | None) -> RegistryCredentialQuerySet:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)


class ImageQuerySet(models.QuerySet["Image"]):
    def for_tenant(self, tenant: Tenant | None) -> ImageQuerySet:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)


class RegistryCredential(models.Model):
    """A tenant's login for one registry host. The password is Fernet-encrypted with a
    key kept outside the database (apps/images/crypto.py) and never leaves the server."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False)
    registry = models.CharField(max_length=255)  # host[:port], as in a reference
    username = models.CharField(max_length=255)
    password_encrypted = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    objects = RegistryCredentialQuerySet.as_manager()

    class Meta:
        ordering = ["registry"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "registry"], name="uniq_registrycredential_tenant_registry"
            )
        ]

    def __str__(self) -> str:
        return f"{self.username}@{self.registry}"


class ImageStatus(models.TextChoices):
    PULLING = "pulling"
    READY = "ready"
    FAILED = "failed"


class Image(models.Model):
    """One (tenant, normalised reference): what the tenant pulled or imported, and the
    manifest digest it resolved to. Several tenants' rows may share one digest (the
    store on disk is shared and content-addressed; access is proved per pull)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False)
    reference = models.CharField(max_length=512)
    digest = models.CharField(max_length=80, blank=True, db_index=True)
    status = models.CharField(
        max_length=16, choices=ImageStatus.choices, default=ImageStatus.PULLING
    )
    size_bytes = models.BigIntegerField(default=0)
    layers = models.PositiveIntegerField(default=0)
    progress = models.JSONField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    private = models.BooleanField(default=False)  # pulled with the tenant's credentials
    imported = models.BooleanField(default=False)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ImageQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "reference"], name="uniq_image_tenant_reference"
            )
        ]

    def __str__(self) -> str:
        return f"{self.reference} ({self.status})"
