"""``quota_lock_for`` (hand-written SQL, apps/billing/quotas.py) reads what the ORM reads:
the tenant's quota row, field for field, and the asking key's own sandbox limit — of
that key of that tenant only — and it holds the row's lock until the transaction ends."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import connection, transaction

from apps.billing.models import ApiKeyLimits, TenantQuota
from apps.billing.quotas import quota_get, quota_lock_for
from apps.tenancy.models import ApiKey


def _fields(quota: TenantQuota) -> dict[str, object]:
    return {f.attname: getattr(quota, f.attname) for f in TenantQuota._meta.concrete_fields}


@pytest.mark.django_db
def test_it_reads_the_quota_row_and_the_keys_limit_as_the_orm_does(make_tenant):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        max_concurrent_sandboxes=7,
        max_cpu_millis=3500,
        max_lifetime_s=900,
        exec_rate_per_s=2.5,
        max_upload_bytes=10**12,
        monthly_budget=Decimal("12.34"),
        queue_by_default=True,
        max_queued=17,
    )
    ApiKeyLimits.objects.create(api_key=key, max_concurrent_sandboxes=3)
    # Another team's key with the same prefix must not lend its limit.
    foreign = ApiKey.objects.get(tenant=other)
    ApiKey.objects.filter(pk=foreign.pk).update(prefix=key.prefix)
    ApiKeyLimits.objects.create(api_key=foreign, max_concurrent_sandboxes=1)

    with transaction.atomic():
        quota, key_max = quota_lock_for(tenant=tenant, actor=f"key:{key.prefix}")
        orm = TenantQuota.objects.select_for_update().get(tenant=tenant)
    assert _fields(quota) == _fields(orm)
    assert quota.monthly_budget == Decimal("12.34") and quota.exec_rate_per_s == 2.5
    assert quota.tenant is tenant
    assert key_max == 3
    with transaction.atomic():
        assert quota_lock_for(tenant=other, actor=f"key:{key.prefix}")[1] == 1
        assert quota_lock_for(tenant=tenant, actor="key:nosuchkey")[1] is None
        assert quota_lock_for(tenant=tenant, actor=f"user:{key.prefix}")[1] is None


@pytest.mark.django_db
def test_it_creates_a_missing_quota_row_with_the_defaults(make_tenant):
    tenant, _ = make_tenant()
    TenantQuota.objects.filter(tenant=tenant).delete()
    with transaction.atomic():
        quota, key_max = quota_lock_for(tenant=tenant, actor="key:x")
    assert quota.pk == TenantQuota.objects.get(tenant=tenant).pk
    assert quota.max_queued == 1000 and quota.max_concurrent_sandboxes is None
    assert key_max is None


@pytest.mark.django_db(transaction=True)
def test_it_holds_the_rows_lock_until_the_transaction_ends(make_tenant):
    tenant, _ = make_tenant()
    quota_get(tenant=tenant)
    outcome: list[str] = []

    def other_session() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '200ms'")
                with transaction.atomic():
                    try:
                        TenantQuota.objects.select_for_update().get(tenant=tenant)
                        outcome.append("got it")
                    except Exception as exc:  # the outcome is the assertion
                        outcome.append(type(exc).__name__)
        finally:
            connection.close()

    with transaction.atomic():
        quota_lock_for(tenant=tenant, actor="")
        thread = threading.Thread(target=other_session)
        thread.start()
        thread.join()
    assert outcome == ["OperationalError"]  # lock_timeout: the row was ours
    thread = threading.Thread(target=other_session)
    thread.start()
    thread.join()
    assert outcome == ["OperationalError", "got it"]
