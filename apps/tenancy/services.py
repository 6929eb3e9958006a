"""Writes for tenants, members and keys (the tenancy floor: no money, no sandboxes)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.core.errors import ApiError, Conflict, ValidationFailed
from apps.tenancy.auth import forget_cached_keys
from apps.tenancy.models import ApiKey, Membership, Role, Scope, Tenant
from apps.tenancy.secrets import KEY_PREFIX, hash_secret

VALID_SCOPES = {s.value for s in Scope}


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
    granted_by: frozenset[str] | None = None,
) -> IssuedKey:
    """Issues a key. The returned secret is the only copy; the row holds its hash.
    With ``granted_by`` (the issuing caller's scopes) the new key gets no scope its
    issuer lacks: a ``read``+``admin`` key cannot mint itself a ``write`` key (403)."""
    chosen = sorted(set(scopes or ["read", "write"]))
    unknown = [s for s in chosen if s not in VALID_SCOPES]
    if unknown:
        raise ValidationFailed(f"unknown scope(s): {', '.join(unknown)}", field="scopes")
    beyond = [s for s in chosen if granted_by is not None and s not in granted_by]
    if beyond:
        raise ApiError(
            f"a key cannot grant scope(s) it lacks: {', '.join(beyond)}",
            field="scopes",
            code="scope_not_held",
            status_code=403,
        )
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
    forget_cached_keys()
    return key


def membership_set_role(*, tenant: Tenant, user: User, role: str) -> Membership:
    if role not in Role.values:
        raise ValidationFailed(f"unknown role {role!r}", field="role")
    membership, _ = Membership.objects.update_or_create(
        tenant=tenant, user=user, defaults={"role": role}
    )
    return membership


# --- Members (the dashboard's Members page) -------------------------------------------


def membership_add(*, tenant: Tenant, username: str, role: str, by_role: str) -> Membership:
    """Adds an existing user to the team. Only owners may make owners; a user who is
    already a member is a 409 (change their role instead)."""
    _check_role_change(role=role, by_role=by_role, previous=None)
    user = User.objects.filter(username=username.strip(), is_active=True).first()
    if user is None:
        raise ValidationFailed(f"no user named {username.strip()!r}", field="username")
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise Conflict(
            f"{user.username} is already a member", field="username", code="member_exists"
        )
    return Membership.objects.create(tenant=tenant, user=user, role=role)


def membership_change_role(*, membership: Membership, role: str, by_role: str) -> Membership:
    """Changes a member's role. Transactional: the team always keeps at least one owner
    (the row is locked so two concurrent demotions cannot both pass the check)."""
    _check_role_change(role=role, by_role=by_role, previous=membership.role)
    with transaction.atomic():
        owners = list(
            Membership.objects.select_for_update()
            .filter(tenant_id=membership.tenant_id, role=Role.OWNER)
            .values_list("pk", flat=True)
        )
        if role != Role.OWNER and owners == [membership.pk]:
            raise ValidationFailed("a team needs at least one owner", field="role")
        Membership.objects.filter(pk=membership.pk).update(role=role)
    membership.refresh_from_db()
    return membership


def membership_remove(*, membership: Membership, by_role: str) -> None:
    """Removes a member from the team (their next request no longer acts for it).
    Owners and admins only; only an owner removes an owner; transactional: the team
    always keeps at least one owner (the owners' rows are locked, as for a demotion)."""
    if by_role not in (Role.OWNER, Role.ADMIN):
        raise ApiError("only owners and admins manage members", code="forbidden", status_code=403)
    if membership.role == Role.OWNER and by_role != Role.OWNER:
        raise ApiError("only owners remove an owner", code="forbidden", status_code=403)
    with transaction.atomic():
        owners = list(
            Membership.objects.select_for_update()
            .filter(tenant_id=membership.tenant_id, role=Role.OWNER)
            .values_list("pk", flat=True)
        )
        if owners == [membership.pk]:
            raise ValidationFailed("a team needs at least one owner", field="membership_id")
        Membership.objects.filter(pk=membership.pk).delete()


def _check_role_change(*, role: str, by_role: str, previous: str | None) -> None:
    if role not in Role.values:
        raise ValidationFailed(f"unknown role {role!r}", field="role")
    if by_role not in (Role.OWNER, Role.ADMIN):
        raise ApiError("only owners and admins manage members", code="forbidden", status_code=403)
    if Role.OWNER in (role, previous) and by_role != Role.OWNER:
        raise ApiError(
            "only owners grant or remove the owner role", code="forbidden", status_code=403
        )
