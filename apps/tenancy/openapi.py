"""How the API's two ways in appear in the OpenAPI schema (/api/schema/, /api/docs/).

drf-spectacular knows DRF's own authentication classes, not ours; without these every
operation's `security` was empty and each view logged a warning. A program reads the
schema to learn that a key goes in `Authorization: Bearer` or `X-API-Key` (either one:
two requirement objects are OR'd), and that the browser's session cookie also works."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "apps.tenancy.auth.ApiKeyAuthentication"
    name = ["bearerAuth", "apiKeyHeader"]

    def get_security_requirement(self, auto_schema: Any) -> list[dict[str, list[str]]]:
        # either header is enough: one requirement object each
        return [{"bearerAuth": []}, {"apiKeyHeader": []}]

    def get_security_definition(self, auto_schema: Any) -> list[dict[str, str]]:
        return [
            {"type": "http", "scheme": "bearer", "description": "a team's API key"},
            {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        ]


class TenantSessionScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "apps.tenancy.auth.TenantSessionAuthentication"
    name = "sessionCookie"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "cookie",
            "name": settings.SESSION_COOKIE_NAME,
            "description": "the dashboard's session (the team chosen in its switcher); "
            "unsafe methods also need the CSRF token",
        }
