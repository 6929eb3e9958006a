"""Server-side, event-driven waits: subscribe first, then read, then block on the event."""

from __future__ import annotations

import time

from django.db import connection

from apps.sandboxes.events import redis_client, sandbox_channel
from apps.sandboxes.models import Sandbox, State

SETTLED_STATES = (State.READY, State.FAILED, State.LOST, State.DELETED, State.TERMINATING)


def sandbox_wait_settled(*, sandbox: Sandbox, timeout_s: float) -> Sandbox:
    """Returns as soon as the sandbox leaves requested/provisioning, or at the timeout.

    Subscribing before re-reading the row closes the race where the transition
    happens between our read and our subscribe.
    """
    if sandbox.state in SETTLED_STATES:
        return sandbox
    pubsub = redis_client().pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    try:
        pubsub.subscribe(sandbox_channel(str(sandbox.id)))
        deadline = time.monotonic() + timeout_s
        while True:
            sandbox.refresh_from_db()
            remaining = deadline - time.monotonic()
            if sandbox.state in SETTLED_STATES or remaining <= 0:
                return sandbox
            # Hand the DB connection back while blocked: a thousand clients waiting at
            # once must not hold a thousand connections (the pool would time out).
            if not connection.in_atomic_block:
                connection.close()
            # Wake on any message for this sandbox, then re-read the row (the source of truth).
            pubsub.get_message(timeout=min(remaining, 5.0))
    finally:
        pubsub.close()
