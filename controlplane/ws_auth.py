"""Websocket authentication: a tenant key in a handshake header (SDK), or the browser's
session with its Origin checked. Puts ``scope["principal"]`` (or None) and, when the
handshake must be refused, ``scope["auth_error"]`` = (code, message, close code)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.auth import AuthMiddlewareStack
from django.conf import settings
from rest_framework.exceptions import AuthenticationFailed

from apps.core.asyncdb import db_async
from apps.tenancy.auth import (
    client_address,
    extract_key,
    principal_for_key,
    principal_for_session,
)
from apps.tenancy.principal import Principal

Scope = dict[str, Any]


class _Headers:
    """Case-insensitive read access to ASGI's list of (bytes, bytes) headers."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._h = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._h.get(name.lower(), default)


def origin_allowed(headers: _Headers) -> bool:
    """Same origin as the Host header, or listed in HEDGEROW_CSRF_TRUSTED_ORIGINS.

    A browser always sends Origin on websockets; without this check any site the user
    visits could open a socket with their session cookie (cross-site hijacking)."""
    origin = headers.get("origin")
    if not origin:
        return False
    if origin in settings.CSRF_TRUSTED_ORIGINS:
        return True
    host = headers.get("host") or ""
    return bool(host) and urlsplit(origin).netloc.lower() == host.lower()


@db_async
def _from_key(secret: str, source: str | None) -> Principal:
    return principal_for_key(secret, source)


@db_async
def _from_session(user: Any, tenant_id: str | None) -> Principal | None:
    return principal_for_session(user, tenant_id)


class PrincipalMiddleware:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> Any:
        scope = dict(scope)
        scope["principal"] = None
        headers = _Headers(scope.get("headers", []))
        secret = extract_key(headers)
        if secret is not None:
            try:
                client = scope.get("client") or ("", 0)
                source = client_address({"REMOTE_ADDR": client[0]})
                scope["principal"] = await _from_key(secret, source)
            except AuthenticationFailed as exc:
                code = getattr(exc, "get_codes", lambda: "invalid_api_key")()
                scope["auth_error"] = (str(code), str(exc.detail), 4401)
        else:
            user = scope.get("user")
            if user is not None and getattr(user, "is_authenticated", False):
                if not origin_allowed(headers):
                    scope["auth_error"] = (
                        "origin_not_allowed",
                        "this Origin may not open a session websocket",
                        4403,
                    )
                else:
                    session = scope.get("session")
                    tenant_id = session.get("tenant_id") if session is not None else None
                    scope["principal"] = await _from_session(user, tenant_id)
        return await self.inner(scope, receive, send)


def WebsocketAuthStack(inner: Any) -> Any:
    return AuthMiddlewareStack(PrincipalMiddleware(inner))
