"""The disk guard (issue 15): a create is refused with a typed 507 ``disk_exhausted``
before the host's disk fills, and leaves nothing behind; the warm pool starts no
member. The reserve is set above the real free space (the disk is never filled)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import Client

from apps.sandboxes.models import Sandbox, SandboxEvent, WarmMember
from apps.sandboxes.services import warm_pool

pytestmark = pytest.mark.django_db


@pytest.fixture
def no_room(settings: Any) -> None:
    # more than the state dir's whole filesystem: below the reserve whatever is free
    total = shutil.disk_usage(django_settings.STATE_DIR).total
    settings.HEDGEROW_IMAGE_MIN_FREE_MIB = (total >> 20) + 1


def _create(client: Client, secret: str) -> Any:
    return client.post(
        "/api/v1/sandboxes",
        data={"image": "host"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )


def test_a_create_is_refused_507_disk_exhausted_and_nothing_is_recorded(
    make_tenant: Any, client: Client, no_room: None
) -> None:
    _, secret = make_tenant()

    response = _create(client, secret)

    assert response.status_code == 507, response.content
    error = response.json()["error"]
    assert error["code"] == "disk_exhausted"
    assert "HEDGEROW_IMAGE_MIN_FREE_MIB" in error["message"]
    assert "state dir" in error["message"]
    assert not Sandbox.objects.exists()
    assert not SandboxEvent.objects.exists()


def test_a_create_with_room_is_accepted(make_tenant: Any, client: Client, settings: Any) -> None:
    settings.HEDGEROW_IMAGE_MIN_FREE_MIB = 1
    _, secret = make_tenant()

    response = _create(client, secret)

    assert response.status_code == 201, response.content
    assert Sandbox.objects.count() == 1


def test_an_orchard_create_is_refused_with_the_same_code(
    make_tenant: Any, client: Client, no_room: None
) -> None:
    _, secret = make_tenant()

    response = client.post(
        "/orchard/sandboxes",
        data={"image": "host", "sandbox_id": "disk-1"},
        content_type="application/json",
        headers={"X-API-Key": secret},
    )

    assert response.status_code == 507, response.content
    assert "disk_exhausted" in response.content.decode()
    assert not Sandbox.objects.exists()


def test_the_warm_pool_starts_no_member_while_the_disk_is_short(
    settings: Any, no_room: None
) -> None:
    settings.HEDGEROW_WARM_POOL = "host:250m:128Mi:none=2"
    enqueued: list[str] = []

    assert warm_pool.warm_pool_refill(enqueue=enqueued.append) == {}
    assert not WarmMember.objects.exists() and enqueued == []

    settings.HEDGEROW_IMAGE_MIN_FREE_MIB = 1
    assert warm_pool.warm_pool_refill(enqueue=enqueued.append) == {"host:250m:128Mi:none": 2}
    assert WarmMember.objects.count() == 2 and len(enqueued) == 2
