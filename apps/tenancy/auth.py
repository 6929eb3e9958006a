"""API authentication: tenant keys by header, or the browser session's current team."""

from __future__ import annotations

import ipaddress
import time
from datetime import timedelta
from typing import Any

from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from apps.core.ids import is_uuid
from apps.tenancy.models import ApiKey, Membership, Role
from apps.tenancy.principal import Principal
from apps.tenancy.secrets import hash_secret

ROLE_SCOPES: dict[str, frozenset[str]] = {
    Role.VIEWER: frozenset({"read"}),
    Role.MEMBER: frozenset({"read", "write"}),
    Role.ADMIN: frozenset({"read", "write", "admin"}),
    Role.OWNER: frozenset({"read", "write", "admin"}),
}
LAST_USED_RESOLUTION = timedelta(seconds=60)


def client_address(meta: Any) -> str | None:
    """The request's client address (REMOTE_ADDR: the peer, or what uvicorn's
    --proxy-headers took from a trusted proxy's X-Forwarded-For), if it is one."""
    value = str(meta.get("REMOTE_ADDR") or "")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


class AuthFailed(exceptions.AuthenticationFailed):
    default_code = "invalid_api_key"


def extract_key(headers: Any) -> str | None:
    """The key from ``Authorization: Bearer`` or ``X-API-Key`` (never from the URL)."""
    header = headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return str(header[7:].strip()) or None
    api_key = headers.get("X-API-Key")
    return str(api_key).strip() or None if api_key else None


# key hash → (principal, cached at). A short in-process cache: the hot path (exec) then
# skips the key lookup. A revoked or expired key, or a disabled team, stops working at
# once in the process that revoked it and within KEY_CACHE_TTL_S everywhere else.
KEY_CACHE_TTL_S = 5.0
KEY_CACHE_MAX = 4096
_key_cache: dict[str, tuple[Principal, float]] = {}
# key id → its secret's hash, which never changes for a key (principal_for_key_id).
_key_digests: dict[str, str] = {}


def forget_cached_keys() -> None:
    """Drops every cached key → principal entry (after a revoke, a rotation, a rename or
    a team change)."""
    _key_cache.clear()
    _key_digests.clear()


def _still_valid(principal: Principal, digest: str) -> bool:
    """A cached principal's key has not expired since, and a secret in its rotation
    grace has not outlived it."""
    key = principal.api_key
    if key is None:
        return False
    now = timezone.now()
    if key.expires_at is not None and key.expires_at <= now:
        return False
    if digest == key.previous_secret_hash:
        return key.previous_valid_until is not None and key.previous_valid_until > now
    return True


def principal_for_key(secret: str, source: str | None = None) -> Principal:
    """Resolves a secret to a principal or raises AuthFailed with a reason. ``source``
    (the client address) is recorded as the key's last-used address."""
    return _principal_cached_by_digest(hash_secret(secret), source)


def _principal_cached_by_digest(digest: str, source: str | None = None) -> Principal:
    cached = _key_cache.get(digest)
    if cached is not None:
        principal, at = cached
        fresh = time.monotonic() - at < KEY_CACHE_TTL_S
        if fresh and _still_valid(principal, digest):
            return principal
        _key_cache.pop(digest, None)
    principal = _principal_for_digest(digest, source)
    if len(_key_cache) >= KEY_CACHE_MAX:
        _key_cache.clear()
    _key_cache[digest] = (principal, time.monotonic())
    if principal.api_key is not None:  # a token naming this key finds it without a read
        if len(_key_digests) >= KEY_CACHE_MAX:
            _key_digests.clear()
        _key_digests[str(principal.api_key.pk)] = digest
    return principal


def principal_cached(secret: str) -> Principal | None:
    """The cached principal for a secret without touching the database, or None (not
    cached, stale, or expired). For the async exec fast path, which sends a miss to the
    regular path: that refreshes this same cache, with the same rules as above."""
    return _principal_cached_digest(hash_secret(secret))


def principal_cached_for_key_id(key_id: str) -> Principal | None:
    """``principal_cached`` for a key named by id (a signed token: the E2B envd fast
    path), or None when this process has not cached it fresh."""
    digest = _key_digests.get(key_id)
    return None if digest is None else _principal_cached_digest(digest)


def principal_refresh_for_key_id(key_id: str) -> Principal | None:
    """``principal_refresh`` for a key named by id: looked up again if this process knew
    the key, else None (the regular path answers)."""
    if key_id not in _key_digests:
        return None
    try:
        return principal_for_key_id(key_id)
    except AuthFailed:
        return None


def _principal_cached_digest(digest: str) -> Principal | None:
    cached = _key_cache.get(digest)
    if cached is None:
        return None
    principal, at = cached
    if time.monotonic() - at < KEY_CACHE_TTL_S and _still_valid(principal, digest):
        return principal
    return None


def principal_refresh(secret: str) -> Principal | None:
    """For the async exec fast path, when ``principal_cached`` missed: the key looked up
    again (and cached) if this process had it cached before, else None — a key never
    seen, or one that no longer authenticates, goes to the regular path, which answers
    it (so a stream of bad keys costs no extra lookups)."""
    if hash_secret(secret) not in _key_cache:
        return None
    try:
        return principal_for_key(secret)
    except AuthFailed:
        return None


def principal_for_key_id(key_id: str) -> Principal:
    """The principal of the key with this id, with every check a secret gets (revoked,
    expired, team disabled). For a signed token that names a key rather than carrying
    its secret (the E2B envd access token, apps/e2b/tokens.py)."""
    if not is_uuid(key_id):
        raise AuthFailed("invalid API key")
    digest = _key_digests.get(key_id)
    if digest is None:
        digest = ApiKey.objects.filter(pk=key_id).values_list("secret_hash", flat=True).first()
        if digest is None:
            raise AuthFailed("invalid API key")
        if len(_key_digests) >= KEY_CACHE_MAX:
            _key_digests.clear()
        _key_digests[key_id] = digest
    # the same cache (and the same revocation delay) as a secret's
    try:
        return _principal_cached_by_digest(digest)
    except AuthFailed:
        # rotated in another process since this one learnt the digest: look it up again
        fresh = ApiKey.objects.filter(pk=key_id).values_list("secret_hash", flat=True).first()
        if fresh is None or fresh == digest:
            raise
        _key_digests[key_id] = fresh
        return _principal_cached_by_digest(fresh)


def _principal_for_digest(digest: str, source: str | None = None) -> Principal:
    now = timezone.now()
    key = (
        ApiKey.objects.select_related("tenant")
        .filter(
            Q(secret_hash=digest) | Q(previous_secret_hash=digest, previous_valid_until__gt=now)
        )
        .first()
    )
    if key is None:
        raise AuthFailed("invalid API key")
    if key.revoked_at is not None:
        raise AuthFailed("this API key was revoked", code="api_key_revoked")
    if key.expires_at is not None and key.expires_at <= now:
        raise AuthFailed("this API key has expired", code="api_key_expired")
    if not key.tenant.is_active:
        raise AuthFailed("this team is disabled", code="tenant_disabled")
    # Written at most once a minute (or when the address changes) so the hot path does
    # not write on every request.
    moved = source is not None and source != key.last_used_from
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION or moved:
        changes: dict[str, Any] = {"last_used_at": now}
        if source is not None:
            changes["last_used_from"] = source
        ApiKey.objects.filter(pk=key.pk).update(**changes)
    return Principal(
        tenant=key.tenant, scopes=frozenset(key.scopes), api_key=key, secret_digest=digest
    )


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Principal, Principal] | None:
        secret = extract_key(request.headers)
        if secret is None:
            return None
        principal = principal_for_key(secret, client_address(request.META))
        return principal, principal

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="hedgerow"'


def principal_for_session(user: Any, tenant_id: str | None) -> Principal | None:
    """The principal of a signed-in user acting for the session's current team."""
    if user is None or not user.is_authenticated:
        return None
    memberships = Membership.objects.select_related("tenant").filter(
        user=user, tenant__is_active=True
    )
    chosen = None
    if tenant_id and is_uuid(tenant_id):  # anything else names no team (never a 500)
        chosen = memberships.filter(tenant_id=tenant_id).first()
    if chosen is None:
        chosen = memberships.order_by("created_at").first()
    if chosen is None:
        return None
    return Principal(
        tenant=chosen.tenant,
        scopes=ROLE_SCOPES.get(chosen.role, frozenset()),
        user=user,
        role=chosen.role,
    )


class TenantSessionAuthentication(authentication.SessionAuthentication):
    """The browser: Django session + the team chosen in the team switcher (CSRF enforced)."""

    def authenticate(self, request: Request) -> tuple[Principal, Principal] | None:
        user = getattr(request._request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        self.enforce_csrf(request)
        principal = principal_for_session(user, request._request.session.get("tenant_id"))
        if principal is None:
            return None
        return principal, principal
