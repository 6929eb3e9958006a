"""Tenancy: tenants, their members and their API keys — the floor every other app
stands on. The tables keep their original names (``billing_*``): they lived in
``apps.billing`` until issue 18 split tenancy from money, and a rename would buy
nothing but a risky migration."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class Tenant(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    is_active = models.BooleanField(default=True)

    class Meta:
        db_table = "billing_tenant"

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    OWNER = "owner"
    ADMIN = "admin"
    MEMBER = "member"
    VIEWER = "viewer"


class Membership(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "billing_membership"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "user"], name="uniq_membership_tenant_user")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.tenant_id}:{self.role}"


class Scope(models.TextChoices):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


class ApiKey(models.Model):
    """A tenant key. Only a SHA-256 of the secret is stored; the secret is shown once."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, db_index=True)
    secret_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The client address of the request that last wrote last_used_at (REMOTE_ADDR).
    last_used_from = models.GenericIPAddressField(null=True, blank=True)
    # Rotation: the secret before the last rotation keeps working until
    # previous_valid_until (the grace period), then is refused like any unknown key.
    previous_secret_hash = models.CharField(
        max_length=64, null=True, blank=True, unique=True, default=None
    )
    previous_valid_until = models.DateTimeField(null=True, blank=True)
    rotated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "billing_apikey"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def is_active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class Action(models.TextChoices):
    """What the team activity log records (docs/security.md#team-activity)."""

    KEY_CREATED = "key.created"
    KEY_REVOKED = "key.revoked"
    KEY_RENAMED = "key.renamed"
    KEY_ROTATED = "key.rotated"
    MEMBER_ADDED = "member.added"
    MEMBER_ROLE_CHANGED = "member.role_changed"
    MEMBER_REMOVED = "member.removed"
    SANDBOX_DELETED = "sandbox.deleted"
    QUOTA_CHANGED = "quota.changed"
    BUDGET_CROSSED = "budget.crossed"


class Activity(models.Model):
    """One thing a person or a key did to a team: who (``actor``), what (``action``), to
    what (``target_*``), and the non-secret particulars (``details``: old and new names,
    roles, quota values, a key's prefix; never a secret). Written by the services that
    do the thing, in the same transaction; kept HEDGEROW_ACTIVITY_RETENTION_DAYS."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="activity")
    at = models.DateTimeField(default=timezone.now)
    actor = models.CharField(max_length=200)
    action = models.CharField(max_length=32, choices=Action.choices)
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64)
    target_name = models.CharField(max_length=200, blank=True, default="")
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "-id"], name="activity_tenant_id"),
            models.Index(fields=["at"], name="activity_at"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target_name}"
