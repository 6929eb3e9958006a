"""Fan-out of state changes: Redis pub/sub for server-side waits, Channels groups for UIs.

Always called after commit, so a listener never sees a state the database does not have.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any

import redis
from asgiref.sync import SyncToAsync, async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction

from apps.core.redis_sync import redis_client
from apps.sandboxes.models import Sandbox

log = logging.getLogger(__name__)


def sandbox_channel(sandbox_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}sandbox:{sandbox_id}"


def tenant_group(tenant_id: str) -> str:
    return f"tenant.{tenant_id}"


def sandbox_state_payload(sandbox: Sandbox) -> dict[str, Any]:
    return {
        "type": "sandbox.state",
        "sandbox_id": sandbox.external_id,
        "state": sandbox.state,
        "generation": sandbox.generation,
        "status_message": sandbox.status_message,
    }


def _group_members_key(layer: Any, group: str) -> tuple[bytes, int] | None:
    """Where channels_redis keeps ``group``'s members (a sorted set of channel names
    scored by when they joined) and how long a member counts, when that set lives in
    the Redis this process publishes to (one host, the same URL); else None."""
    from channels_redis.core import RedisChannelLayer

    if not isinstance(layer, RedisChannelLayer):
        return None
    hosts = layer.hosts
    if len(hosts) != 1 or hosts[0].get("address") != settings.REDIS_URL:
        return None
    return layer._group_key(group), int(layer.group_expiry)


def _publish(sandbox_uuid: str, tenant_id: str, payload: dict[str, Any]) -> None:
    layer = get_channel_layer()
    group = tenant_group(tenant_id)
    members = _group_members_key(layer, group) if layer is not None else None
    try:
        if members is None:
            redis_client().publish(sandbox_channel(sandbox_uuid), json.dumps(payload))
        else:
            # With the publish, count the group's live members (those group_send would
            # not discard as expired): with no UI open for the tenant — the usual case
            # for the worker's transitions — the group_send (a hop to the fan-out loop
            # and two Redis round trips there) is skipped. A UI joining after this
            # count misses the message as it would joining after group_send's read.
            key, expiry = members
            pipe = redis_client().pipeline(transaction=False)
            pipe.publish(sandbox_channel(sandbox_uuid), json.dumps(payload))
            pipe.zcount(key, f"({int(time.time()) - expiry}", "+inf")
            if pipe.execute()[1] == 0:
                return
    except (redis.RedisError, OSError, ValueError):
        # Best effort, like the fan-out below: a transition has committed by now and a
        # publish that fails must not turn into the provision's own failure. A reset
        # connection can surface from redis-py as a ValueError (its reader's buffer
        # closed under it), seen in a fork's provisioning threads under load.
        log.warning("could not publish sandbox state", extra={"sandbox_id": sandbox_uuid})
    if layer is not None:
        try:
            if _asgi_loop_behind_this_thread():
                async_to_sync(layer.group_send)(group, payload)
            else:
                sent = asyncio.run_coroutine_threadsafe(
                    layer.group_send(group, payload), _fanout_loop()
                )
                sent.result(timeout=5)
        except Exception:  # noqa: BLE001 - a UI fan-out failure must never break a transition
            log.warning("could not fan out sandbox state", extra={"sandbox_id": sandbox_uuid})


def _asgi_loop_behind_this_thread() -> bool:
    """True in a sync view's thread under ASGI: async_to_sync then runs the send on the
    server's own loop (asgiref records that loop in this thread-local)."""
    loop = getattr(SyncToAsync.threadlocal, "main_event_loop", None)
    return loop is not None and loop.is_running()


_fanout_loops: dict[int, asyncio.AbstractEventLoop] = {}
_fanout_lock = threading.Lock()


def _fanout_loop() -> asyncio.AbstractEventLoop:
    """One long-lived event loop per process, in a daemon thread, for fan-outs from sync
    code with no ASGI loop behind it (Celery tasks, the watcher, commands). There,
    async_to_sync builds a new loop, thread and Redis connection on every call (~1 ms
    of CPU, three times per sandbox in the worker). Keyed by pid: a forked Celery
    child starts its own."""
    pid = os.getpid()
    loop = _fanout_loops.get(pid)
    if loop is None:
        with _fanout_lock:
            loop = _fanout_loops.get(pid)
            if loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="hedgerow-fanout", daemon=True
                ).start()
                _fanout_loops[pid] = loop
    return loop


def publish_tenant_event(tenant_id: str, payload: dict[str, Any]) -> None:
    """A UI-only event for the tenant's ``/ws/realtime`` sockets subscribed to the
    ``sandboxes`` topic (e.g. ``image.progress``): no Redis pub/sub waiter needs it, and
    with no UI open nothing is sent. Never raises."""
    layer = get_channel_layer()
    if layer is None:
        return
    group = tenant_group(tenant_id)
    members = _group_members_key(layer, group)
    try:
        if members is not None:
            key, expiry = members
            if redis_client().zcount(key, f"({int(time.time()) - expiry}", "+inf") == 0:
                return
        if _asgi_loop_behind_this_thread():
            async_to_sync(layer.group_send)(group, payload)
        else:
            asyncio.run_coroutine_threadsafe(
                layer.group_send(group, payload), _fanout_loop()
            ).result(timeout=5)
    except Exception:  # noqa: BLE001 - a UI fan-out failure must never break a pull
        log.warning("could not fan out a tenant event", extra={"event": payload.get("type")})


def publish_sandbox_state(sandbox: Sandbox) -> None:
    payload = sandbox_state_payload(sandbox)
    sandbox_uuid, tenant_id = str(sandbox.id), str(sandbox.tenant_id)
    transaction.on_commit(lambda: _publish(sandbox_uuid, tenant_id, payload))
