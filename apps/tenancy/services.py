"""Writes for tenants, members and keys (the tenancy floor: no money, no sandboxes)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from apps.core.errors import ApiError, Conflict, ValidationFailed
from apps.tenancy.activity import activity_record
from apps.tenancy.auth import forget_cached_keys
from apps.tenancy.models import Action, ApiKey, Membership, Role, Scope, Tenant
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
    actor: str = "",
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
    name = _key_name(name)
    secret = _new_secret()
    with transaction.atomic():
        key = ApiKey.objects.create(
            tenant=tenant,
            name=name,
            prefix=secret[: len(KEY_PREFIX) + 8],
            secret_hash=hash_secret(secret),
            scopes=chosen,
            expires_at=expires_at,
            created_by=created_by,
        )
        _key_activity(key, actor or _user_actor(created_by), Action.KEY_CREATED, scopes=chosen)
    return IssuedKey(key=key, secret=secret)


def _new_secret() -> str:
    return f"{KEY_PREFIX}{secrets.token_urlsafe(32)}"


def _key_name(name: str) -> str:
    name = name.strip()
    if not name:
        raise ValidationFailed("a key needs a name", field="name")
    if len(name) > 200:
        raise ValidationFailed("a key name is at most 200 characters", field="name")
    return name


def _user_actor(user: User | None) -> str:
    return f"user:{user.username}" if user is not None else "system"


def _key_activity(key: ApiKey, actor: str, action: Action, **details: object) -> None:
    activity_record(
        tenant=key.tenant_id,
        actor=actor,
        action=action,
        target_type="api_key",
        target_id=str(key.pk),
        target_name=key.name,
        details={"prefix": key.prefix, **details},
    )


def api_key_revoke(*, key: ApiKey, actor: str = "system") -> ApiKey:
    """Revokes a key (and any secret still in a rotation grace). Idempotent: revoking
    twice keeps the first revocation time and is logged once."""
    with transaction.atomic():
        revoked = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        key.refresh_from_db()
        if revoked:
            _key_activity(key, actor, Action.KEY_REVOKED)
    forget_cached_keys()
    return key


def api_key_rename(*, key: ApiKey, name: str, actor: str) -> ApiKey:
    """Renames a key (its secret and prefix stay). Renaming to the same name is a no-op."""
    name = _key_name(name)
    if name == key.name:
        return key
    with transaction.atomic():
        old = key.name
        ApiKey.objects.filter(pk=key.pk).update(name=name)
        key.refresh_from_db()
        _key_activity(key, actor, Action.KEY_RENAMED, old_name=old, new_name=name)
    forget_cached_keys()
    return key


def api_key_rotate(*, key: ApiKey, actor: str, grace_seconds: int | None = None) -> IssuedKey:
    """Gives the key a new secret (returned once) and keeps the current one working for
    ``grace_seconds`` (default HEDGEROW_KEY_ROTATION_GRACE_S; 0 ends it at once), after
    which it is refused. The key keeps its id, name, scopes and expiry; its prefix is
    the new secret's. Only the secret just replaced gets a grace: rotating again ends
    an older one's at once. A revoked or expired key is a 409. Transactional, and the
    row is locked so two rotations cannot both keep "the" old secret."""
    grace = settings.HEDGEROW_KEY_ROTATION_GRACE_S if grace_seconds is None else grace_seconds
    if not 0 <= grace <= settings.HEDGEROW_KEY_ROTATION_MAX_GRACE_S:
        raise ValidationFailed(
            f"grace_seconds must be 0 to {settings.HEDGEROW_KEY_ROTATION_MAX_GRACE_S}",
            field="grace_seconds",
        )
    secret = _new_secret()
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        if not locked.is_active:
            state = "revoked" if locked.revoked_at is not None else "expired"
            raise Conflict(f"this key is {state}", code=f"api_key_{state}", field=None)
        now = timezone.now()
        old_prefix = locked.prefix
        locked.previous_secret_hash = locked.secret_hash if grace > 0 else None
        locked.previous_valid_until = now + timedelta(seconds=grace) if grace > 0 else None
        locked.secret_hash = hash_secret(secret)
        locked.prefix = secret[: len(KEY_PREFIX) + 8]
        locked.rotated_at = now
        locked.save(
            update_fields=[
                "previous_secret_hash",
                "previous_valid_until",
                "secret_hash",
                "prefix",
                "rotated_at",
            ]
        )
        _key_activity(
            locked,
            actor,
            Action.KEY_ROTATED,
            old_prefix=old_prefix,
            grace_seconds=grace,
        )
    forget_cached_keys()
    return IssuedKey(key=locked, secret=secret)


def membership_set_role(*, tenant: Tenant, user: User, role: str) -> Membership:
    if role not in Role.values:
        raise ValidationFailed(f"unknown role {role!r}", field="role")
    membership, _ = Membership.objects.update_or_create(
        tenant=tenant, user=user, defaults={"role": role}
    )
    return membership


# --- Members (the dashboard's Members page) -------------------------------------------


def _member_activity(membership: Membership, actor: str, action: Action, **details: object) -> None:
    activity_record(
        tenant=membership.tenant_id,
        actor=actor,
        action=action,
        target_type="member",
        target_id=str(membership.user_id),
        target_name=membership.user.username,
        details=details,
    )


def membership_add(
    *, tenant: Tenant, username: str, role: str, by_role: str, actor: str = "system"
) -> Membership:
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
    with transaction.atomic():
        membership = Membership.objects.create(tenant=tenant, user=user, role=role)
        _member_activity(membership, actor, Action.MEMBER_ADDED, role=role)
    return membership


def membership_change_role(
    *, membership: Membership, role: str, by_role: str, actor: str = "system"
) -> Membership:
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
        previous = Membership.objects.filter(pk=membership.pk).values_list("role", flat=True)
        old_role = previous.first()
        Membership.objects.filter(pk=membership.pk).update(role=role)
        if old_role != role:
            _member_activity(
                membership, actor, Action.MEMBER_ROLE_CHANGED, old_role=old_role, new_role=role
            )
    membership.refresh_from_db()
    return membership


def membership_remove(*, membership: Membership, by_role: str, actor: str = "system") -> None:
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
        if Membership.objects.filter(pk=membership.pk).delete()[0]:
            _member_activity(membership, actor, Action.MEMBER_REMOVED, role=membership.role)


def _check_role_change(*, role: str, by_role: str, previous: str | None) -> None:
    if role not in Role.values:
        raise ValidationFailed(f"unknown role {role!r}", field="role")
    if by_role not in (Role.OWNER, Role.ADMIN):
        raise ApiError("only owners and admins manage members", code="forbidden", status_code=403)
    if Role.OWNER in (role, previous) and by_role != Role.OWNER:
        raise ApiError(
            "only owners grant or remove the owner role", code="forbidden", status_code=403
        )
