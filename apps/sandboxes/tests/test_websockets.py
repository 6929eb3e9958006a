"""Websocket auth, tenant isolation and bad input against the real ASGI app
(channels' WebsocketCommunicator; no sandbox needed)."""

from __future__ import annotations

from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.contrib.auth.models import User
from django.test import Client

from apps.core.asyncdb import db_async
from apps.sandboxes.events import tenant_group
from apps.sandboxes.tests.wscomm import WebsocketCommunicator
from apps.tenancy.services import tenant_create
from controlplane.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def _comm(path: str, headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
    return WebsocketCommunicator(application, path, headers=headers)


def _key(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {secret}".encode())]


async def _open(path: str, headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
    comm = _comm(path, headers)
    connected, _ = await comm.connect()
    assert connected
    return comm


async def _closed_with(comm: WebsocketCommunicator) -> tuple[dict[str, Any], int]:
    error = await comm.receive_json_from(timeout=5)
    closed = await comm.receive_output(timeout=5)
    assert closed["type"] == "websocket.close"
    return error, int(closed["code"])


def _session_cookie() -> bytes:
    user = User.objects.create_user("ada", password="pw-ada-123")
    tenant_create(slug="ada-team", owner=user)
    client = Client()
    assert client.login(username="ada", password="pw-ada-123")
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def test_it_closes_an_unauthenticated_or_bad_key_socket_with_4401(make_tenant):
    comm = await _open("/ws/realtime", [])
    error, code = await _closed_with(comm)
    assert (error["code"], code) == ("not_authenticated", 4401)

    comm = await _open("/ws/realtime", _key("hr_not_a_key"))
    error, code = await _closed_with(comm)
    assert (error["code"], code) == ("invalid_api_key", 4401)


async def test_it_checks_the_origin_of_session_sockets():
    cookie = await db_async(_session_cookie)()
    evil = [(b"cookie", cookie), (b"host", b"testserver"), (b"origin", b"http://evil.example")]
    comm = await _open("/ws/realtime", evil)
    error, code = await _closed_with(comm)
    assert (error["code"], code) == ("origin_not_allowed", 4403)

    same = [(b"cookie", cookie), (b"host", b"testserver"), (b"origin", b"http://testserver")]
    comm = await _open("/ws/realtime", same)
    await comm.send_json_to({"type": "subscribe", "topic": "sandboxes"})
    assert await comm.receive_json_from(timeout=5) == {"type": "subscribed", "topic": "sandboxes"}
    await comm.disconnect()


async def test_it_sends_sandbox_state_only_to_the_owning_tenant(make_tenant):
    owner, owner_secret = await db_async(make_tenant)()
    _, other_secret = await db_async(make_tenant)()
    mine = await _open("/ws/realtime", _key(owner_secret))
    theirs = await _open("/ws/realtime", _key(other_secret))
    for comm in (mine, theirs):
        await comm.send_json_to({"type": "subscribe", "topic": "sandboxes"})
        assert (await comm.receive_json_from(timeout=5))["type"] == "subscribed"
    event = {"type": "sandbox.state", "sandbox_id": "sb-1", "state": "ready", "generation": 1,
             "status_message": ""}  # fmt: skip
    await get_channel_layer().group_send(tenant_group(str(owner.pk)), event)
    assert await mine.receive_json_from(timeout=5) == event
    assert await theirs.receive_nothing(timeout=0.5)
    await mine.disconnect()
    await theirs.disconnect()


async def test_it_answers_unknown_operations_and_malformed_frames_without_crashing(make_tenant):
    _, secret = await db_async(make_tenant)()
    comm = await _open("/ws/realtime", _key(secret))
    bad = [
        ("{nope", None),
        ("[1, 2]", "type"),
        ('{"type": "dance"}', "type"),
        ('{"type": "subscribe", "topic": "everything"}', "topic"),
        ('{"type": "subscribe", "topic": "operation", "sandbox_id": 5}', None),
        (
            '{"type": "subscribe", "topic": "operation", "sandbox_id": "s", '
            '"operation_id": "o", "after_seq": "-7"}',
            "after_seq",
        ),
    ]
    for text, field in bad:
        await comm.send_to(text_data=text)
        error = await comm.receive_json_from(timeout=5)
        assert (error["type"], error["code"], error["field"]) == ("error", "bad_frame", field)
    await comm.send_json_to(
        {"type": "subscribe", "topic": "operation", "sandbox_id": "nope", "operation_id": "op-x"}
    )
    error = await comm.receive_json_from(timeout=5)
    assert (error["type"], error["code"]) == ("error", "not_found")
    await comm.send_to(text_data="x" * (70 * 1024))
    error, code = await _closed_with(comm)
    assert (error["code"], code) == ("too_large", 4400)

    stream = await _open("/ws/v1/sandboxes/nope/operations/op-x/stream", _key(secret))
    error, code = await _closed_with(stream)
    assert (error["code"], code) == ("not_found", 4404)


async def test_it_refuses_a_terminal_to_a_read_only_key(make_tenant):
    _, secret = await db_async(make_tenant)(scopes=["read"])
    comm = await _open("/ws/v1/sandboxes/anything/pty", _key(secret))
    error, code = await _closed_with(comm)
    assert (error["code"], code) == ("permission_denied", 4403)
