"""One subscriber's view of one operation's frames: replay from the Redis stream, then
the live tail from the Channels group, deduplicated and gap-filled by ``seq``.

Frames the replay buffer no longer keeps (a subscriber that fell more than its window
behind) are announced by one ``exec.gap`` frame with what it skipped — bytes and lines
per stream — from the output totals stored with each frame (services/replay.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from apps.core.asyncdb import db_async
from apps.sandboxes import selectors
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services import replay
from apps.sandboxes.services.streaming import (
    frames_key,
    operation_group,
    operation_recover,
    pump_alive,
)
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 2.0
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class OperationRef:
    pk: str
    sandbox_id: str
    operation_id: str
    # What the subscribe-time check found: (status, final record or None).
    initial: tuple[str, dict[str, Any] | None] = ("running", None)


@db_async
def find_operation(principal: Principal, sandbox_id: str, operation_id: str) -> OperationRef:
    """Tenant-scoped: another tenant's operation raises the same NotFound as a missing one.
    Also checks it once (``_check_sync``), so subscribing costs one thread hop."""
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    operation = selectors.operation_get(
        tenant=principal.tenant, sandbox=sandbox, operation_id=operation_id
    )
    operation.sandbox = sandbox
    return OperationRef(
        str(operation.pk), sandbox.external_id, operation.operation_id, _check_sync(operation)
    )


@db_async
def _check(pk: str) -> tuple[str, dict[str, Any] | None]:
    return _check_sync(Operation.objects.select_related("sandbox").get(pk=pk))


def _check_sync(operation: Operation) -> tuple[str, dict[str, Any] | None]:
    """(status, final record or None); recovers a running operation whose pump died."""
    from apps.sandboxes.api.serializers import OperationSerializer

    pk = str(operation.pk)
    if operation.status == OperationStatus.RUNNING and not pump_alive(pk):
        operation = operation_recover(operation=operation)
    if operation.status == OperationStatus.RUNNING:
        return operation.status, None
    return operation.status, json.loads(
        json.dumps(OperationSerializer(operation).data, default=str)
    )


class OperationFeed:
    def __init__(
        self,
        *,
        ref: OperationRef,
        after_seq: int,
        send: Send,
        redis: aioredis.Redis,
        on_done: Callable[[OperationFeed], Awaitable[None]],
    ) -> None:
        self.ref = ref
        self.last = after_seq
        self.send = send
        self.redis = redis
        self.on_done = on_done
        self.done = False
        # Output totals after the last frame sent ("ob ol eb el"); None while unknown
        # (a re-subscribe whose last frame the buffer no longer has).
        self.totals: str | None = replay.ZERO if after_seq < 0 else None
        self.group = operation_group(ref.pk)
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None

    def _ids(self) -> dict[str, str]:
        return {"sandbox_id": self.ref.sandbox_id, "operation_id": self.ref.operation_id}

    async def start(self) -> None:
        """Call after joining the group: frames that arrive meanwhile are deduped."""
        await self.catch_up()
        if not self.done:
            self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        self.done = True
        task = self._watchdog
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def on_group_frame(
        self, raw: str, before: str | None = None, after: str | None = None
    ) -> None:
        if self.done:
            return
        frame = json.loads(raw)
        async with self._lock:
            if frame["seq"] <= self.last:
                return
            if frame["seq"] > self.last + 1:
                # channels_redis dropped something (full channel): the stream has it.
                await self._replay_locked(upto=frame["seq"] - 1)
            if not self.done and frame["seq"] > self.last:
                await self._emit(frame, before, after)

    async def catch_up(self) -> None:
        async with self._lock:
            await self._replay_locked(upto=None)

    async def _replay_locked(self, *, upto: int | None) -> None:
        maximum = "+" if upto is None else f"0-{upto + 1}"
        # From the last frame sent when its totals are not known yet (a re-subscribe
        # with after_seq): they are the base a gap's size is counted from.
        first = self.last + (2 if self.totals is not None else 1)
        entries = await self.redis.xrange(frames_key(self.ref.pk), f"0-{first}", maximum)
        for _entry_id, fields in entries:
            frame = json.loads(fields[b"f"])
            after = _text(fields.get(b"a"))
            if frame["seq"] == self.last and self.totals is None:
                self.totals = after
            if frame["seq"] <= self.last:
                continue
            await self._emit(frame, _text(fields.get(b"b")), after)
            if self.done:
                return

    async def _emit(
        self, frame: dict[str, Any], before: str | None = None, after: str | None = None
    ) -> None:
        seq = int(frame["seq"])
        if seq > self.last + 1:
            gap: dict[str, Any] = {
                "type": "exec.gap",
                **self._ids(),
                "from_seq": self.last + 1,
                "to_seq": seq - 1,
            }
            size = (
                None
                if self.totals is None or before is None
                else replay.skipped(self.totals, before)
            )
            if size is not None:
                gap["skipped"] = size
            await self.send(gap)
        self.last = seq
        self.totals = after
        if frame["type"] == "exec.exit":
            _status, record = await _check(self.ref.pk)
            await self._finish(record, seq)
            return
        await self.send({**frame, **self._ids()})

    async def _finish(self, record: dict[str, Any] | None, seq: int | None) -> None:
        self.done = True
        await self.send({"type": "exec.exit", **self._ids(), "seq": seq, "result": record})
        await self.on_done(self)

    async def _watch(self) -> None:
        """Ends the feed from the database when no exit frame will come (a relay that
        died and was recovered elsewhere, or a non-streamed exec), and triggers recovery."""
        try:
            while not self.done:
                await asyncio.sleep(WATCHDOG_INTERVAL_S)
                status, record = await _check(self.ref.pk)
                if status == OperationStatus.RUNNING or self.done:
                    continue
                await self.catch_up()
                if not self.done:
                    async with self._lock:
                        if not self.done:
                            await self._finish(record, None)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("operation feed watchdog failed", extra={"operation": self.ref.pk})


async def start_feed(feed: OperationFeed, *, channel_layer: Any, channel_name: str) -> None:
    await channel_layer.group_add(feed.group, channel_name)
    _status, record = feed.ref.initial
    await feed.start()
    if not feed.done and record is not None:
        # Final in the database but the buffer has no exit (expired, or a non-streamed
        # exec): the stored record is the whole answer.
        async with feed._lock:
            if not feed.done:
                await feed._finish(record, None)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else None


def new_redis() -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(settings.REDIS_URL)
    return client
