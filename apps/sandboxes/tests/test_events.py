"""State fan-out (Redis pub/sub for waits, the channel layer for UIs) and the
server-side wait that listens to it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from apps.core.redis_sync import redis_client
from apps.sandboxes import events
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.waiting import sandbox_wait_settled
from apps.sandboxes.tests.factories import make_sandbox


def test_it_fans_out_to_the_tenant_group_from_threads_without_an_event_loop():
    layer = get_channel_layer()
    assert layer is not None
    tenant_id = uuid.uuid4().hex
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(events.tenant_group(tenant_id), channel)

    async def receive() -> dict[str, object]:
        return await asyncio.wait_for(layer.receive(channel), timeout=10)

    for state in ("provisioning", "ready"):  # the second send reuses the process's loop
        payload = {"type": "sandbox.state", "sandbox_id": "sb-x", "state": state}
        # A Celery task's thread: no ASGI loop behind it.
        sender = threading.Thread(target=events._publish, args=("x", tenant_id, payload))
        sender.start()
        sender.join()
        assert async_to_sync(receive)() == payload
    async_to_sync(layer.group_discard)(events.tenant_group(tenant_id), channel)


def test_it_publishes_for_waits_but_skips_the_group_send_when_no_ui_is_in_the_group(
    monkeypatch,
):
    layer = get_channel_layer()
    assert layer is not None
    tenant_id, sandbox_uuid = uuid.uuid4().hex, uuid.uuid4().hex
    sends: list[str] = []
    real_group_send = layer.group_send

    async def counting_group_send(group: str, message: dict[str, Any]) -> None:
        sends.append(group)
        await real_group_send(group, message)

    monkeypatch.setattr(layer, "group_send", counting_group_send)
    pubsub = redis_client().pubsub()
    pubsub.subscribe(events.sandbox_channel(sandbox_uuid))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    payload = {"type": "sandbox.state", "sandbox_id": "sb-x", "state": "ready"}

    events._publish(sandbox_uuid, tenant_id, payload)  # nobody in the tenant's group
    message = pubsub.get_message(timeout=5)
    assert message is not None and json.loads(message["data"]) == payload
    assert sends == []

    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(events.tenant_group(tenant_id), channel)
    events._publish(sandbox_uuid, tenant_id, payload)  # a UI joined: it gets the state
    assert sends == [events.tenant_group(tenant_id)]
    assert async_to_sync(layer.receive)(channel) == payload
    async_to_sync(layer.group_discard)(events.tenant_group(tenant_id), channel)
    pubsub.close()


def test_it_shares_one_result_backend_across_request_threads():
    # Under ASGI each request runs in a new thread; a per-thread backend was rebuilt
    # (entry points scanned) on every enqueue.
    from controlplane.celery import app

    seen: list[object] = []
    for _ in range(2):
        thread = threading.Thread(target=lambda: seen.append(app.backend))
        thread.start()
        thread.join()
    assert seen[0] is seen[1]


@pytest.mark.django_db
def test_it_waits_through_published_unsettled_states_without_rereading(make_tenant, monkeypatch):
    from redis.client import PubSub

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    channel = events.sandbox_channel(str(sandbox.id))
    from apps.sandboxes import selectors

    real_refresh, real_get = selectors.sandbox_refresh, PubSub.get_message
    reads: list[str] = []
    polls: list[int] = []

    def refresh(*, sandbox: Sandbox) -> None:
        real_refresh(sandbox=sandbox)
        reads.append(sandbox.state)
        if len(reads) == 1:  # subscribed by now: the worker claims the sandbox
            redis_client().publish(channel, json.dumps({"state": State.PROVISIONING}))

    def get_message(self: PubSub, *args: Any, **kwargs: Any) -> Any:
        polls.append(1)
        if len(polls) == 2:  # after `provisioning` was taken: the sandbox becomes ready
            Sandbox.objects.filter(pk=sandbox.pk).update(state=State.READY, generation=1)
            redis_client().publish(channel, json.dumps({"state": State.READY}))
        return real_get(self, *args, **kwargs)

    monkeypatch.setattr(selectors, "sandbox_refresh", refresh)
    monkeypatch.setattr(PubSub, "get_message", get_message)
    settled = sandbox_wait_settled(sandbox=sandbox, timeout_s=30)
    assert settled.state == State.READY
    # Read once after subscribing and once on `ready`; `provisioning` needs no read.
    assert reads == [State.REQUESTED, State.READY]


def _subscribers(channel: str) -> int:
    counts: list[tuple[Any, int]] = redis_client().pubsub_numsub(channel)  # type: ignore[assignment]
    return sum(n for name, n in counts if name in (channel, channel.encode()))


def test_it_keeps_one_subscriber_connection_per_thread_and_leaves_it_unsubscribed(
    transactional_db, make_tenant
):
    from apps.sandboxes.services import waiting

    tenant, _ = make_tenant()
    first = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    second = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    assert sandbox_wait_settled(sandbox=first, timeout_s=0.2).state == State.REQUESTED
    kept = waiting._threads.pubsub
    assert kept is not None and kept.connection is not None
    assert not kept.subscribed and not kept.channels
    connection = kept.connection
    # Published after that wait ended: nobody listens on this connection any more.
    redis_client().publish(events.sandbox_channel(str(first.id)), "late")

    def ready_soon() -> None:
        # once the waiter listens on the second sandbox's channel (a state, not a nap)
        channel = events.sandbox_channel(str(second.id))
        deadline = time.monotonic() + 30
        while not _subscribers(channel):
            assert time.monotonic() < deadline, "the waiter never subscribed"
            time.sleep(0.01)
        Sandbox.objects.filter(pk=second.pk).update(state=State.READY, generation=1)
        redis_client().publish(
            events.sandbox_channel(str(second.id)), json.dumps({"state": State.READY})
        )

    thread = threading.Thread(target=ready_soon)
    thread.start()
    assert sandbox_wait_settled(sandbox=second, timeout_s=30).state == State.READY
    thread.join()
    assert waiting._threads.pubsub is kept and kept.connection is connection
    assert not kept.subscribed

    connection.disconnect()  # Redis dropped it while the thread was idle
    assert sandbox_wait_settled(sandbox=first, timeout_s=0.2).state == State.REQUESTED
    assert waiting._threads.pubsub is kept and not kept.subscribed
