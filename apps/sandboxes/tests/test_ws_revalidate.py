"""An open websocket re-checks its credential: a revoked, expired or re-scoped key, a
disabled team, a removed member, a changed role or a signed-out session closes it
with 4401/4403 within HEDGEROW_WS_REVALIDATE_S (in-process; the terminal and stream
sockets through the real stack are in test_ws_revalidate_live.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.test import Client
from django.utils import timezone

from apps.core.asyncdb import db_async
from apps.sandboxes.tests.wscomm import WebsocketCommunicator
from apps.tenancy.models import ApiKey, Membership, Role, Tenant
from apps.tenancy.services import api_key_revoke, tenant_create
from controlplane.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

INTERVAL_S = 0.3


@pytest.fixture(autouse=True)
def _fast_revalidation(settings: Any) -> None:
    settings.HEDGEROW_WS_REVALIDATE_S = INTERVAL_S


async def _open(headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, "/ws/realtime", headers=headers)
    connected, _ = await comm.connect()
    assert connected
    await comm.send_json_to({"type": "subscribe", "topic": "sandboxes"})
    assert (await comm.receive_json_from(timeout=5))["type"] == "subscribed"
    return comm


async def _closes_within(comm: WebsocketCommunicator, seconds: float) -> tuple[str, int]:
    """The error frame's code and the close code, which must come within ``seconds``."""
    start = time.monotonic()
    error = await comm.receive_json_from(timeout=seconds + 2)
    closed = await comm.receive_output(timeout=2)
    assert time.monotonic() - start <= seconds + 1.0
    assert error["type"] == "error" and closed["type"] == "websocket.close", closed
    return str(error["code"]), int(closed["code"])


def _key_headers(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {secret}".encode())]


async def _key_socket(make_tenant: Any) -> tuple[Tenant, WebsocketCommunicator]:
    tenant, secret = await db_async(make_tenant)()
    return tenant, await _open(_key_headers(secret))


def _only_key(tenant: Tenant) -> ApiKey:
    return ApiKey.objects.get(tenant=tenant)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: api_key_revoke(key=_only_key(t)), ("api_key_revoked", 4401)),
        (lambda t: _only_key(t).delete(), ("api_key_revoked", 4401)),
        (
            lambda t: ApiKey.objects.filter(tenant=t).update(
                expires_at=timezone.now() - timedelta(seconds=1)
            ),
            ("api_key_expired", 4401),
        ),
        (
            lambda t: Tenant.objects.filter(pk=t.pk).update(is_active=False),
            ("tenant_disabled", 4401),
        ),
        (
            lambda t: ApiKey.objects.filter(tenant=t).update(scopes=["read"]),
            ("permissions_changed", 4403),
        ),
    ],
    ids=["revoked", "deleted", "expired", "tenant-disabled", "scopes-reduced"],
)
async def test_a_key_socket_closes_when_the_key_stops_holding(
    make_tenant: Any, change: Callable[[Tenant], Any], expected: tuple[str, int]
) -> None:
    tenant, comm = await _key_socket(make_tenant)
    # still open after more than one check while nothing changed
    assert await comm.receive_nothing(timeout=INTERVAL_S * 3)
    await db_async(change)(tenant)
    assert await _closes_within(comm, INTERVAL_S) == expected


def _signed_in(username: str) -> tuple[User, Tenant, bytes]:
    user = User.objects.create_user(username, password="pw-123456")
    tenant = tenant_create(slug=f"{username}-team", owner=user)
    client = Client()
    assert client.login(username=username, password="pw-123456")
    return user, tenant, client.cookies["sessionid"].value.encode()


def _session_headers(session_key: bytes) -> list[tuple[bytes, bytes]]:
    return [
        (b"cookie", b"sessionid=" + session_key),
        (b"host", b"testserver"),
        (b"origin", b"http://testserver"),
    ]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda u, t, s: Membership.objects.filter(user=u, tenant=t).delete(),
            ("membership_removed", 4401),
        ),
        (lambda u, t, s: Session.objects.filter(session_key=s).delete(), ("session_ended", 4401)),
        (
            lambda u, t, s: User.objects.filter(pk=u.pk).update(is_active=False),
            ("session_ended", 4401),
        ),
        (
            lambda u, t, s: Tenant.objects.filter(pk=t.pk).update(is_active=False),
            ("tenant_disabled", 4401),
        ),
        (
            lambda u, t, s: Membership.objects.filter(user=u, tenant=t).update(role=Role.VIEWER),
            ("permissions_changed", 4403),
        ),
    ],
    ids=["member-removed", "signed-out", "user-disabled", "tenant-disabled", "role-changed"],
)
async def test_a_session_socket_closes_when_the_session_or_membership_stops_holding(
    change: Callable[[User, Tenant, str], Any], expected: tuple[str, int]
) -> None:
    user, tenant, session_key = await db_async(_signed_in)("grace")
    comm = await _open(_session_headers(session_key))
    assert await comm.receive_nothing(timeout=INTERVAL_S * 3)
    await db_async(change)(user, tenant, session_key.decode())
    assert await _closes_within(comm, INTERVAL_S) == expected
