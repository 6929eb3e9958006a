"""Fan-out of state changes: Redis pub/sub for server-side waits, Channels groups for UIs.

Always called after commit, so a listener never sees a state the database does not have.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction

from apps.sandboxes.models import Sandbox

log = logging.getLogger(__name__)


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


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


def _publish(sandbox_uuid: str, tenant_id: str, payload: dict[str, Any]) -> None:
    try:
        redis_client().publish(sandbox_channel(sandbox_uuid), json.dumps(payload))
    except redis.RedisError:
        log.warning("could not publish sandbox state", extra={"sandbox_id": sandbox_uuid})
    layer = get_channel_layer()
    if layer is not None:
        try:
            async_to_sync(layer.group_send)(tenant_group(tenant_id), payload)
        except Exception:  # noqa: BLE001 - a UI fan-out failure must never break a transition
            log.warning("could not fan out sandbox state", extra={"sandbox_id": sandbox_uuid})


def publish_sandbox_state(sandbox: Sandbox) -> None:
    payload = sandbox_state_payload(sandbox)
    sandbox_uuid, tenant_id = str(sandbox.id), str(sandbox.tenant_id)
    transaction.on_commit(lambda: _publish(sandbox_uuid, tenant_id, payload))
