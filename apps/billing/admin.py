from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from apps.billing.models import (
    ApiKeyLimits,
    DailyUsage,
    PriceBook,
    PriceRate,
    TenantQuota,
    UsageRecord,
)
from apps.billing.services import quota_update
from apps.tenancy.models import ApiKey, Membership, Tenant


class TenantQuotaInline(admin.StackedInline):  # type: ignore[type-arg]
    model = TenantQuota
    can_delete = False
    extra = 0
    # The owners' webhook may carry a token: never shown back, not even to staff.
    exclude = ["alert_webhook_url"]


class ApiKeyLimitsInline(admin.StackedInline):  # type: ignore[type-arg]
    model = ApiKeyLimits
    can_delete = False
    extra = 0


class MembershipInline(admin.TabularInline):  # type: ignore[type-arg]
    model = Membership
    extra = 0


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["slug", "name", "is_active", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline, TenantQuotaInline]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "prefix",
        "name",
        "tenant",
        "scopes",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    list_filter = ["tenant"]
    readonly_fields = [
        "prefix",
        "secret_hash",
        "last_used_at",
        "last_used_from",
        "previous_secret_hash",
        "previous_valid_until",
        "rotated_at",
    ]
    inlines = [ApiKeyLimitsInline]


@admin.register(TenantQuota)
class TenantQuotaAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "tenant",
        "max_concurrent_sandboxes",
        "max_cpu_millis",
        "max_memory_mib",
        "max_concurrent_execs",
        "exec_rate_per_s",
        "monthly_budget",
        "queue_by_default",
        "updated_at",
    ]
    list_editable = ["max_concurrent_sandboxes", "monthly_budget", "queue_by_default"]
    search_fields = ["tenant__slug"]
    exclude = ["alert_webhook_url"]  # may carry a token (docs/billing.md)

    def save_model(self, request: HttpRequest, obj: TenantQuota, form: Any, change: bool) -> None:
        """Edits go through the service, so the team's activity log records them."""
        if not change:
            super().save_model(request, obj, form, change)
            return
        stored = TenantQuota.objects.get(pk=obj.pk)
        changes = {name: getattr(obj, name) for name in form.changed_data}
        quota_update(quota=stored, changes=changes, actor=f"staff:{request.user.get_username()}")


class PriceRateInline(admin.TabularInline):  # type: ignore[type-arg]
    model = PriceRate
    extra = 0


@admin.register(PriceBook)
class PriceBookAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["slug", "version", "name", "is_reference", "effective_from", "currency"]
    list_filter = ["is_reference", "slug"]
    inlines = [PriceRateInline]


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The usage ledger is derived from the lifecycle ledger: read-only here."""

    list_display = [
        "sandbox",
        "tenant",
        "image",
        "capacity_type",
        "cpu_millis",
        "memory_mib",
        "started_at",
        "ended_at",
        "end_state",
        "price_book",
    ]
    list_filter = ["tenant", "end_state", "capacity_type"]
    date_hierarchy = "started_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(DailyUsage)
class DailyUsageAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["day", "tenant", "dimension", "value", "sandboxes", "cost"]
    list_filter = ["dimension", "day", "tenant"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
