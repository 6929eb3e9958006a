"""The envd access token: what the E2B SDK sends to the data plane instead of its key.

The SDK sends ``X-API-KEY`` only to the control plane; to envd it sends
``X-Access-Token`` with the ``envdAccessToken`` the create (or connect) answered. Ours
is signed (Django's signing, the deployment's SECRET_KEY), never stored: it names one
sandbox and the API key that asked for it, so it grants exactly what that key may do on
that sandbox, and stops working when the key is revoked, expires or loses its team.
"""

from __future__ import annotations

from typing import Any

from django.core import signing

from apps.core.errors import ApiError
from apps.tenancy.auth import AuthFailed, principal_for_key_id
from apps.tenancy.principal import Principal

SALT = "hedgerow.e2b.envd-access-token"


class Unauthenticated(ApiError):
    status_code = 401
    code = "unauthenticated"


def envd_token(*, principal: Principal, sandbox_pk: Any) -> str | None:
    """A token for this key and sandbox (None for a session principal: it has no key)."""
    if principal.api_key is None:
        return None
    return signing.dumps({"s": str(sandbox_pk), "k": str(principal.api_key.pk)}, salt=SALT)


def envd_principal(token: str) -> tuple[Principal, str]:
    """(the key's principal, the sandbox pk) a token names; 401 when it is not ours or
    its key no longer authenticates."""
    if not token:
        raise Unauthenticated("missing X-Access-Token header")
    try:
        data = signing.loads(token, salt=SALT)
    except signing.BadSignature:
        raise Unauthenticated("invalid access token") from None
    if not isinstance(data, dict) or not {"s", "k"} <= set(data):
        raise Unauthenticated("invalid access token")
    try:
        principal = principal_for_key_id(str(data["k"]))
    except AuthFailed as exc:
        raise Unauthenticated(str(exc.detail)) from exc
    return principal, str(data["s"])
