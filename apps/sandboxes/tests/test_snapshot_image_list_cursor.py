"""The snapshot and image lists of the API page by cursor too (issue 20): a walk returns
every row of the team exactly once — rows created in the same instant, and one created
mid-walk, included — never another team's; a bad cursor is a 400; offset pages stay."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.images.models import Image, ImageStatus
from apps.sandboxes.models import Snapshot, SnapshotState
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def _snapshot(tenant: Any, sandbox: Any) -> str:
    now = timezone.now()
    snap = Snapshot.objects.create(
        tenant=tenant,
        sandbox=sandbox,
        backend=sandbox.backend,
        image="host",
        state=SnapshotState.READY,
        ttl_seconds=3600,
        expires_at=now + timedelta(hours=1),
    )
    return str(snap.pk)


def _image(tenant: Any, i: int) -> str:
    image = Image.objects.create(
        tenant=tenant, reference=f"ghcr.io/acme/img{i:03d}:1", status=ImageStatus.READY
    )
    return str(image.pk)


def _walk(api: Any, path: str, on_page: Callable[[int], None], key: str = "id") -> list[str]:
    """Every row's ``key`` along a cursor walk of ``path``, 3 a page; ``on_page(n)``
    after the n-th page (to change the list mid-walk)."""
    seen: list[str] = []
    cursor, pages = "", 0
    while True:
        response = api.get(path, {"limit": 3, "cursor": cursor})
        assert response.status_code == 200, response.content
        body = response.json()
        assert "count" not in body
        seen += [str(row[key]) for row in body["results"]]
        pages += 1
        on_page(pages)
        cursor = body["next_cursor"]
        if cursor is None:
            return seen
        assert len(body["results"]) == 3


@pytest.mark.parametrize("kind", ["snapshots", "sandbox_snapshots", "images"])
def test_a_cursor_walk_returns_every_row_once(make_tenant, api_client, kind):
    tenant, secret = make_tenant()
    other, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    elsewhere = make_sandbox(tenant)  # its snapshots are not the sandbox's
    if kind == "images":
        mine = {_image(tenant, i) for i in range(10)}
        theirs = {_image(other, 100 + i) for i in range(2)}
        model: Any = Image
        path = "/api/v1/images"

        def make() -> str:
            return _image(tenant, 999)

    else:
        mine = {_snapshot(tenant, sandbox) for _ in range(10)}
        theirs = {_snapshot(other, make_sandbox(other)) for _ in range(2)}
        if kind == "sandbox_snapshots":
            theirs |= {_snapshot(tenant, elsewhere)}
        model = Snapshot
        path = (
            f"/api/v1/sandboxes/{sandbox.external_id}/snapshots"
            if kind == "sandbox_snapshots"
            else "/api/v1/snapshots"
        )

        def make() -> str:
            return _snapshot(tenant, sandbox)

    if kind == "snapshots":
        mine |= {_snapshot(tenant, elsewhere)}
    # four created in the same instant: the id breaks the tie
    model.objects.filter(pk__in=sorted(mine)[:4]).update(
        created_at=timezone.now().replace(microsecond=0)
    )
    late: list[str] = []
    seen = _walk(api_client(secret), path, lambda page: late.append(make()) if page == 2 else None)
    assert len(seen) == len(set(seen)) == len(mine)
    assert set(seen) == mine and not set(seen) & theirs and not set(seen) & set(late)


@pytest.mark.parametrize("path", ["/api/v1/snapshots", "/api/v1/images"])
def test_a_bad_cursor_is_a_400_and_offset_pages_stay(make_tenant, api_client, path):
    tenant, secret = make_tenant()
    _image(tenant, 1)
    _snapshot(tenant, make_sandbox(tenant))
    api = api_client(secret)
    response = api.get(path, {"cursor": "not-a-cursor"})
    assert response.status_code == 400 and response.json()["error"]["field"] == "cursor"
    assert api.get(path, {"cursor": "", "limit": 500}).status_code == 400
    legacy = api.get(path, {"limit": 1, "offset": 0}).json()
    assert legacy["count"] == 1 and "next_cursor" not in legacy
