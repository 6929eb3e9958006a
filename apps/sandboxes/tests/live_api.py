"""What the live-stack tests share: a client of the REST API with a key, a ready
sandbox, and waiting until a team's sandboxes are all final (every compatibility
layer's tests import these from here: one copy)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from apps.sandboxes.models import Sandbox, State
from apps.tenancy.models import Tenant


def api_client(live: Any, secret: str, prefix: str = "/api/v1") -> httpx.Client:
    """A client of the live stack under ``prefix`` (``/orchard`` takes X-API-Key)."""
    return httpx.Client(
        base_url=live.url + prefix,
        headers={"Authorization": f"Bearer {secret}", "X-API-Key": secret},
        timeout=90,
        trust_env=False,
    )


def ready_sandbox(http: httpx.Client, timeout: int = 60, **spec: Any) -> str:
    """Creates a ``host`` sandbox (``spec`` adds fields) and waits until it is ready."""
    created = http.post("/sandboxes", json={"image": "host", **spec})
    assert created.status_code in (200, 201), created.text
    sandbox_id = str(created.json()["id"])
    waited = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": timeout})
    assert waited.status_code == 200, waited.text
    return sandbox_id


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
