from __future__ import annotations

from django.contrib.auth.models import User
from django.db.models import QuerySet

from apps.core.errors import NotFound
from apps.core.ids import is_uuid
from apps.tenancy.models import ApiKey, Membership, Tenant


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).order_by("-created_at")


def api_key_get(*, tenant: Tenant, key_id: str) -> ApiKey:
    key = ApiKey.objects.filter(tenant=tenant, pk=key_id).first() if is_uuid(key_id) else None
    if key is None:
        raise NotFound(f"no API key {key_id!r}", code="api_key_not_found")
    return key


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return (
        Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")
    )


def membership_get(*, tenant: Tenant, membership_id: str) -> Membership:
    membership = (
        Membership.objects.filter(tenant=tenant, pk=int(membership_id)).first()
        if membership_id.isdigit()
        else None
    )
    if membership is None:
        raise NotFound(f"no member {membership_id!r}", code="member_not_found")
    return membership


def teams_of_user(*, user: User) -> QuerySet[Membership]:
    """The user's active teams, for the team switcher."""
    return (
        Membership.objects.filter(user=user, tenant__is_active=True)
        .select_related("tenant")
        .order_by("tenant__name")
    )
