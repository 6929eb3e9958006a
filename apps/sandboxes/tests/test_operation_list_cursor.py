"""The operation list pages by cursor (issue 20: a sandbox's operations grow with every
exec): a walk returns every row exactly once, also across rows created in the same
instant, and another team's sandbox stays a 404."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.sandboxes.models import Operation, Sandbox, State

pytestmark = pytest.mark.django_db


def _sandbox_with_operations(tenant: Any, n: int) -> Sandbox:
    now = timezone.now()
    sandbox = Sandbox.objects.create(
        tenant=tenant,
        external_id=f"sb-{uuid.uuid4().hex[:8]}",
        state=State.READY,
        generation=1,
        image="host",
        cpu_millis=1000,
        memory_mib=512,
        ttl_seconds=3600,
        expires_at=now + timedelta(hours=1),
        backend="local",
    )
    Operation.objects.bulk_create(
        Operation(
            tenant=tenant,
            sandbox=sandbox,
            operation_id=f"op-{i:04d}",
            generation=1,
            request_hash="x",
            status="completed",
            # groups of 7 share an instant: the id breaks the tie
            created_at=now - timedelta(seconds=i // 7),
        )
        for i in range(n)
    )
    return sandbox


def test_a_cursor_walk_returns_every_operation_once(make_tenant: Any, api_client: Any) -> None:
    tenant, secret = make_tenant()
    sandbox = _sandbox_with_operations(tenant, 123)
    client = api_client(secret)
    url = f"/api/v1/sandboxes/{sandbox.external_id}/operations"
    seen: list[str] = []
    first = client.get(url, {"limit": 50}).json()
    assert first["count"] == 123
    page = first
    pages = 1
    while True:
        seen += [row["id"] for row in page["results"]]
        if page["next_cursor"] is None:
            assert page["next"] is None
            break
        assert "cursor=" in page["next"]
        page = client.get(url, {"limit": 50, "cursor": page["next_cursor"]}).json()
        assert page["count"] is None  # counted on the first page only
        pages += 1
    assert pages == 3
    assert len(seen) == len(set(seen)) == 123
    assert set(seen) == {f"op-{i:04d}" for i in range(123)}
    # newest first
    assert seen[0] in {f"op-{i:04d}" for i in range(7)}


def test_offset_paging_still_answers_and_tenancy_holds(make_tenant: Any, api_client: Any) -> None:
    tenant, secret = make_tenant()
    sandbox = _sandbox_with_operations(tenant, 12)
    url = f"/api/v1/sandboxes/{sandbox.external_id}/operations"
    legacy = api_client(secret).get(url, {"limit": 5, "offset": 10}).json()
    assert legacy["count"] == 12 and len(legacy["results"]) == 2
    bad = api_client(secret).get(url, {"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "limit"
    _, other = make_tenant()
    assert api_client(other).get(url).status_code == 404
