"""Helpers for tests against the live stack."""

from __future__ import annotations

import time

from apps.billing.models import Tenant
from apps.sandboxes.models import Sandbox, State


def wait_all_deleted(tenant: Tenant, timeout: float = 90.0) -> None:
    """Blocks until every sandbox of the tenant is final, so no destroy task is still
    writing when the test database is flushed (TRUNCATE would deadlock with it)."""
    deadline = time.monotonic() + timeout
    unsettled = Sandbox.objects.filter(tenant=tenant).exclude(
        state__in=(State.DELETED, State.FAILED, State.LOST)
    )
    while unsettled.exists():
        assert time.monotonic() < deadline, list(unsettled.values_list("external_id", "state"))
        time.sleep(0.2)
