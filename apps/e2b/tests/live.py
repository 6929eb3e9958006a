"""Helpers for driving the real E2B SDK against the live stack."""

from __future__ import annotations

import time
from typing import Any

from apps.billing.models import Tenant
from apps.sandboxes.models import Sandbox, State


def opts(live: Any, secret: str) -> dict[str, Any]:
    """The SDK's connection options for this stack: what E2B_API_URL, E2B_SANDBOX_URL
    and E2B_API_KEY set (docs/e2b.md)."""
    return {
        "api_key": secret,
        "api_url": live.url + "/e2b",
        "sandbox_url": live.url + "/e2b/envd",
        "request_timeout": 90,
    }


def wait_all_deleted(tenant: Tenant, timeout: float = 90.0) -> None:
    """Blocks until every sandbox of the tenant is final, so no destroy task is still
    writing when the test database is flushed."""
    deadline = time.monotonic() + timeout
    unsettled = Sandbox.objects.filter(tenant=tenant).exclude(
        state__in=(State.DELETED, State.FAILED, State.LOST)
    )
    while unsettled.exists():
        assert time.monotonic() < deadline, list(unsettled.values_list("external_id", "state"))
        time.sleep(0.2)
