"""``tenant_use`` (hand-written SQL, apps/billing/quotas.py) gives the ORM aggregate's
answer: live count, cpu and memory, and queue length, for one tenant only."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import Count, Q, Sum

from apps.sandboxes.admission.use import TenantUse, tenant_use
from apps.sandboxes.models import LIVE_STATES, Sandbox, State
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def _orm_use(tenant_id: Any) -> TenantUse:
    live = Q(state__in=LIVE_STATES)
    row = Sandbox.objects.filter(
        tenant_id=tenant_id, state__in=(*LIVE_STATES, State.QUEUED)
    ).aggregate(
        n=Count("pk", filter=live),
        cpu=Sum("cpu_millis", filter=live),
        mem=Sum("memory_mib", filter=live),
        queued=Count("pk", filter=Q(state=State.QUEUED)),
    )
    return TenantUse(
        live=row["n"] or 0,
        cpu_millis=row["cpu"] or 0,
        memory_mib=row["mem"] or 0,
        queued=row["queued"] or 0,
    )


def test_it_counts_what_the_orm_aggregate_counts(make_tenant):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    empty, _ = make_tenant()
    for i, state in enumerate(State.values):
        make_sandbox(tenant, state=state, cpu_millis=100 + i, memory_mib=64 * (i + 1))
        make_sandbox(tenant, state=state, cpu_millis=7, memory_mib=32)
    make_sandbox(other, state=State.READY, cpu_millis=5000, memory_mib=4096)
    make_sandbox(other, state=State.QUEUED)
    use = tenant_use(tenant_id=tenant.pk)
    assert use == _orm_use(tenant.pk)
    assert use.live == 2 * len(LIVE_STATES) and use.queued == 2
    assert use.cpu_millis > 0 and use.memory_mib > 0
    assert tenant_use(tenant_id=other.pk) == TenantUse(
        live=1, cpu_millis=5000, memory_mib=4096, queued=1
    )
    assert tenant_use(tenant_id=str(other.pk)) == _orm_use(other.pk)
    assert tenant_use(tenant_id=empty.pk) == TenantUse(0, 0, 0, 0) == _orm_use(empty.pk)
