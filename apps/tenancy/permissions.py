from __future__ import annotations

from typing import Any

from rest_framework import permissions
from rest_framework.request import Request

from apps.tenancy.principal import Principal

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


class HasTenantScope(permissions.BasePermission):
    """Reads need ``read``, writes need ``write``; a view may demand ``required_scope``."""

    message = "this key lacks the scope this request needs"

    def has_permission(self, request: Request, view: Any) -> bool:
        principal = request.user
        if not isinstance(principal, Principal):
            return False
        needed = getattr(view, "required_scope", None)
        if needed is None:
            needed = "read" if request.method in SAFE_METHODS else "write"
        return principal.has_scope(needed)


def principal_of(request: Request) -> Principal:
    principal = request.user
    assert isinstance(principal, Principal), "HasTenantScope guarantees a Principal"
    return principal
