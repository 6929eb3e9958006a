from __future__ import annotations

from django.db.models import QuerySet

from apps.billing.models import ApiKey, Tenant
from controlplane.errors import NotFound


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).order_by("-created_at")


def api_key_get(*, tenant: Tenant, key_id: str) -> ApiKey:
    key = ApiKey.objects.filter(tenant=tenant, pk=key_id).first() if _is_uuid(key_id) else None
    if key is None:
        raise NotFound(f"no API key {key_id!r}", code="api_key_not_found")
    return key


def _is_uuid(value: str) -> bool:
    import uuid

    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
