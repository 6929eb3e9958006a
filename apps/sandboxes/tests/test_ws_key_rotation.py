"""An open websocket and key rotation: a socket opened with the old secret stays open
through the grace period and closes (4401 api_key_rotated) when it ends; one opened
with the new secret stays open. Opening a socket records the key's last-used address."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.core.asyncdb import db_async
from apps.sandboxes.tests.test_ws_revalidate import INTERVAL_S, _closes_within, _key_headers, _open
from apps.tenancy.models import ApiKey
from apps.tenancy.services import api_key_rotate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def _fast_revalidation(settings: Any) -> None:
    settings.HEDGEROW_WS_REVALIDATE_S = INTERVAL_S


def _rotate(tenant: Any, grace: int) -> str:
    key = ApiKey.objects.get(tenant=tenant)
    return api_key_rotate(key=key, actor="user:test", grace_seconds=grace).secret


def _end_grace(tenant: Any) -> None:
    ApiKey.objects.filter(tenant=tenant).update(
        previous_valid_until=timezone.now() - timedelta(seconds=1)
    )


def _last_used_from(tenant: Any) -> str | None:
    return ApiKey.objects.get(tenant=tenant).last_used_from


async def test_the_old_secrets_socket_closes_when_the_grace_ends(make_tenant: Any) -> None:
    tenant, old = await db_async(make_tenant)()
    old_socket = await _open(_key_headers(old))
    assert await db_async(_last_used_from)(tenant) == "127.0.0.1"  # the socket's peer
    new = await db_async(_rotate)(tenant, 3600)
    new_socket = await _open(_key_headers(new))
    # within the grace both stay open across several checks
    assert await old_socket.receive_nothing(timeout=INTERVAL_S * 3)
    assert await new_socket.receive_nothing(timeout=INTERVAL_S * 0.5)
    await db_async(_end_grace)(tenant)
    assert await _closes_within(old_socket, INTERVAL_S) == ("api_key_rotated", 4401)
    assert await new_socket.receive_nothing(timeout=INTERVAL_S * 3)
    await new_socket.disconnect()


async def test_a_rotation_without_grace_closes_the_old_secrets_socket(make_tenant: Any) -> None:
    tenant, old = await db_async(make_tenant)()
    socket = await _open(_key_headers(old))
    await db_async(_rotate)(tenant, 0)
    assert await _closes_within(socket, INTERVAL_S) == ("api_key_rotated", 4401)
