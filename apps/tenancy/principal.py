from __future__ import annotations

from dataclasses import dataclass, field

from django.contrib.auth.models import User

from apps.tenancy.models import ApiKey, Tenant


@dataclass
class Principal:
    """Who is calling, for which tenant, with which scopes. ``request.user`` on the API."""

    tenant: Tenant
    scopes: frozenset[str]
    api_key: ApiKey | None = None
    user: User | None = None
    role: str = ""
    is_authenticated: bool = field(default=True)
    # The SHA-256 of the secret this principal authenticated with (a key's current
    # secret, or the one before a rotation during its grace): what a long-lived socket
    # re-checks, so rotating a key closes sockets opened with the old secret once its
    # grace ends.
    secret_digest: str = ""

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    @property
    def actor(self) -> str:
        """How the ledger names this caller."""
        if self.api_key is not None:
            return f"key:{self.api_key.prefix}"
        if self.user is not None:
            return f"user:{self.user.username}"
        return "unknown"
