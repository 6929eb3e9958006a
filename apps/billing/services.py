"""Writes for tenants, members and keys."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.billing.models import ApiKey, Membership, Role, Scope, Tenant
from controlplane.errors import ValidationFailed

KEY_PREFIX = "hr_"
VALID_SCOPES = {s.value for s in Scope}


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedKey:
    key: ApiKey
    secret: str  # shown once, never stored


def tenant_create(*, slug: str, name: str = "", owner: User | None = None) -> Tenant:
    """Creates a tenant (and the owner's membership). Transactional."""
    with transaction.atomic():
        tenant = Tenant.objects.create(slug=slug, name=name or slug)
        if owner is not None:
            Membership.objects.create(tenant=tenant, user=owner, role=Role.OWNER)
    return tenant


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    created_by: User | None = None,
) -> IssuedKey:
    """Issues a key. The returned secret is the only copy; the row holds its hash."""
    chosen = sorted(set(scopes or ["read", "write"]))
    unknown = [s for s in chosen if s not in VALID_SCOPES]
    if unknown:
        raise ValidationFailed(f"unknown scope(s): {', '.join(unknown)}", field="scopes")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationFailed("expiry must be in the future", field="expires_at")
    body = secrets.token_urlsafe(32)
    secret = f"{KEY_PREFIX}{body}"
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=secret[: len(KEY_PREFIX) + 8],
        secret_hash=hash_secret(secret),
        scopes=chosen,
        expires_at=expires_at,
        created_by=created_by,
    )
    return IssuedKey(key=key, secret=secret)


def api_key_revoke(*, key: ApiKey) -> ApiKey:
    """Revokes a key. Idempotent: revoking twice keeps the first revocation time."""
    ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    key.refresh_from_db()
    return key


def membership_set_role(*, tenant: Tenant, user: User, role: str) -> Membership:
    if role not in Role.values:
        raise ValidationFailed(f"unknown role {role!r}", field="role")
    membership, _ = Membership.objects.update_or_create(
        tenant=tenant, user=user, defaults={"role": role}
    )
    return membership
