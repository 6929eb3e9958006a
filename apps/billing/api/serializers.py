from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.billing.models import PriceBook, PriceRate, TenantQuota
from apps.core.egress import EgressError, parse_egress


class TenantQuotaSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """Staff-editable limits; null means unlimited."""

    tenant = serializers.CharField(source="tenant.slug", read_only=True)

    class Meta:
        model = TenantQuota
        fields = [
            "tenant",
            "max_concurrent_sandboxes",
            "max_cpu_millis",
            "max_memory_mib",
            "max_lifetime_s",
            "max_concurrent_execs",
            "exec_rate_per_s",
            "exec_burst",
            "max_upload_bytes",
            "upload_bytes_per_day",
            "max_pty_sessions",
            "monthly_budget",
            "queue_by_default",
            "max_queued",
            "egress_allow_all",
            "egress_patterns",
            "updated_at",
        ]
        read_only_fields = ["tenant", "updated_at"]

    def validate_egress_patterns(self, value: Any) -> Any:
        if value is None or value == []:
            return value  # [] : no allowlist at all
        try:
            return parse_egress({"allow": value}).to_json()["allow"]  # type: ignore[index]
        except EgressError as exc:
            raise serializers.ValidationError(exc.message, code=exc.code) from exc


class PriceRateSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = PriceRate
        fields = ["capacity_type", "vcpu_hour", "gib_hour", "startup_fee"]


class PriceBookSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    rates = PriceRateSerializer(many=True, read_only=True)

    class Meta:
        model = PriceBook
        fields = [
            "slug",
            "name",
            "version",
            "is_reference",
            "effective_from",
            "currency",
            "notes",
            "rates",
        ]
