"""``/ws/v1/sandboxes/<id>/operations/<op>/stream`` and ``/ws/realtime``."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from apps.core.errors import NotFound
from apps.sandboxes.consumers.base import BadFrame, HedgerowConsumer
from apps.sandboxes.consumers.feeds import (
    OperationFeed,
    find_operation,
    new_redis,
    start_feed,
)
from apps.sandboxes.events import tenant_group

MAX_SUBSCRIPTIONS = 64


def _after_seq(value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadFrame("after_seq must be an integer >= -1", "after_seq")
    try:
        seq = int(value)
    except ValueError:
        raise BadFrame("after_seq must be an integer >= -1", "after_seq") from None
    if seq < -1:
        raise BadFrame("after_seq must be an integer >= -1", "after_seq")
    return seq


class _FeedsMixin(HedgerowConsumer):
    """Routes ``exec.frame`` group messages to this socket's operation feeds."""

    feeds: dict[str, OperationFeed]

    async def _open_feed(self, sandbox_id: str, operation_id: str, after_seq: int) -> bool:
        if not self.principal.has_scope("read"):
            await self.fail("permission_denied", "this key lacks the read scope", close_code=4403)
            return False
        try:
            ref = await find_operation(self.principal, sandbox_id, operation_id)
        except NotFound as exc:
            await self.fail(
                "not_found", exc.message, close_code=None if not self.close_on_bad_frame else 4404
            )
            return False
        if ref.pk in self.feeds:
            return True
        if not hasattr(self, "redis"):
            self.redis = new_redis()
        feed = OperationFeed(
            ref=ref,
            after_seq=after_seq,
            send=self.send_json,
            redis=self.redis,
            on_done=self._feed_done,
        )
        self.feeds[ref.pk] = feed
        await start_feed(feed, channel_layer=self.channel_layer, channel_name=self.channel_name)
        return True

    async def _feed_done(self, feed: OperationFeed) -> None:
        self.feeds.pop(feed.ref.pk, None)
        await self.channel_layer.group_discard(feed.group, self.channel_name)

    async def exec_frame(self, event: dict[str, Any]) -> None:
        feed = self.feeds.get(str(event.get("op")))
        if feed is not None:
            await feed.on_group_frame(event["frame"], event.get("b"), event.get("a"))

    async def disconnect(self, code: int) -> None:
        self.closed = True
        for feed in list(getattr(self, "feeds", {}).values()):
            await feed.stop()
            await self.channel_layer.group_discard(feed.group, self.channel_name)
        redis = getattr(self, "redis", None)
        if redis is not None:
            await redis.aclose()


class OperationStreamConsumer(_FeedsMixin):
    """SDK socket for one operation: replay after ``after_seq``, live tail, exit, close."""

    async def on_connect(self) -> None:
        self.feeds = {}
        kwargs = self.scope["url_route"]["kwargs"]
        query = parse_qs(self.scope.get("query_string", b"").decode())
        try:
            after = _after_seq(query.get("after_seq", [None])[0])
        except BadFrame as exc:
            await self.fail("bad_frame", exc.message, field=exc.field, close_code=4400)
            return
        await self._open_feed(kwargs["sandbox_id"], kwargs["operation_id"], after)

    async def _feed_done(self, feed: OperationFeed) -> None:
        await super()._feed_done(feed)
        await self.close_with(1000)


class RealtimeConsumer(_FeedsMixin):
    """The browser's one socket: ``sandboxes`` state events and operation streams."""

    close_on_bad_frame = False

    async def on_connect(self) -> None:
        self.feeds = {}
        self.tenant_group: str | None = None

    async def on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind not in ("subscribe", "unsubscribe"):
            raise BadFrame(f"unknown frame type {kind!r}", "type")
        topic = message.get("topic")
        if topic == "sandboxes":
            await self._sandboxes(subscribe=kind == "subscribe")
        elif topic == "operation":
            sandbox_id, operation_id = message.get("sandbox_id"), message.get("operation_id")
            if not isinstance(sandbox_id, str) or not isinstance(operation_id, str):
                raise BadFrame("operation topics need sandbox_id and operation_id strings")
            if kind == "subscribe":
                if len(self.feeds) >= MAX_SUBSCRIPTIONS:
                    await self.fail("too_many_subscriptions", "unsubscribe from something first")
                    return
                after = _after_seq(message.get("after_seq"))
                ids = {"sandbox_id": sandbox_id, "operation_id": operation_id}
                if await self._open_feed(sandbox_id, operation_id, after):
                    await self.send_json({"type": "subscribed", "topic": "operation", **ids})
            else:
                await self._close_feed(sandbox_id, operation_id)
        else:
            raise BadFrame("topic must be 'sandboxes' or 'operation'", "topic")

    async def _sandboxes(self, *, subscribe: bool) -> None:
        group = tenant_group(str(self.principal.tenant.pk))
        if subscribe:
            await self.channel_layer.group_add(group, self.channel_name)
            self.tenant_group = group
            await self.send_json({"type": "subscribed", "topic": "sandboxes"})
        else:
            await self.channel_layer.group_discard(group, self.channel_name)
            self.tenant_group = None
            await self.send_json({"type": "unsubscribed", "topic": "sandboxes"})

    async def _close_feed(self, sandbox_id: str, operation_id: str) -> None:
        for feed in list(self.feeds.values()):
            if (feed.ref.sandbox_id, feed.ref.operation_id) == (sandbox_id, operation_id):
                await feed.stop()
                await self._feed_done(feed)
        await self.send_json(
            {
                "type": "unsubscribed",
                "topic": "operation",
                "sandbox_id": sandbox_id,
                "operation_id": operation_id,
            }
        )

    async def sandbox_state(self, event: dict[str, Any]) -> None:
        if self.tenant_group is not None:
            await self.send_json(dict(event))

    async def image_progress(self, event: dict[str, Any]) -> None:
        """A pull's progress and outcome (apps/images), on the same tenant topic."""
        if self.tenant_group is not None:
            await self.send_json(dict(event))

    async def disconnect(self, code: int) -> None:
        if getattr(self, "tenant_group", None):
            await self.channel_layer.group_discard(self.tenant_group, self.channel_name)
        await super().disconnect(code)
