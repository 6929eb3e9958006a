"""What every Hedgerow websocket shares: the principal from the handshake, typed
error frames, and limits on what a client may send."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from apps.tenancy.principal import Principal
from apps.tenancy.revalidate import Lost, watch_principal

log = logging.getLogger(__name__)

MAX_CLIENT_FRAME = 64 * 1024


class BadFrame(Exception):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class HedgerowConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]
    """Accepts, authenticates, then hands JSON objects to ``on_message`` and bytes to
    ``on_binary``. A malformed frame is an ``error`` frame (and a close when
    ``close_on_bad_frame``); a flood or an oversized frame always closes."""

    close_on_bad_frame = True
    max_frame = MAX_CLIENT_FRAME
    principal: Principal

    async def connect(self) -> None:
        self.closed = False
        self._window_start = time.monotonic()
        self._window_count = 0
        await self.accept()
        auth_error = self.scope.get("auth_error")
        if auth_error is not None:
            code, message, close_code = auth_error
            await self.fail(code, message, close_code=close_code)
            return
        principal = self.scope.get("principal")
        if not isinstance(principal, Principal):
            await self.fail(
                "not_authenticated",
                "send a key in the Authorization header, or sign in",
                close_code=4401,
            )
            return
        self.principal = principal
        try:
            await self.on_connect()
        except Exception:
            log.exception("websocket connect failed")
            await self.fail("internal_error", "internal error", close_code=4500)
        if not self.closed:
            # The handshake's check is not forever: a revoked key, a removed member or
            # a signed-out session closes the socket within HEDGEROW_WS_REVALIDATE_S.
            session = self.scope.get("session")
            self._revalidation = asyncio.create_task(
                watch_principal(
                    principal,
                    getattr(session, "session_key", None) if principal.user else None,
                    closed=lambda: self.closed,
                    on_lost=self._credential_lost,
                )
            )

    async def _credential_lost(self, lost: Lost) -> None:
        # closed first: what the teardown reports (the terminal ended) must not win
        await self.fail(lost.code, lost.message, close_code=lost.close_code)
        await self.on_credential_lost()

    async def on_credential_lost(self) -> None:
        """Subclasses: stop what the socket drives (a terminal) before it closes."""

    async def on_connect(self) -> None:
        """Subclasses: check permission on the URL's objects and start."""

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closed:
            return
        if not self._within_rate():
            await self.fail("rate_limited", "too many messages; slow down", close_code=4429)
            return
        size = len(text_data) if text_data is not None else len(bytes_data or b"")
        if size > self.max_frame:
            await self.fail(
                "too_large", f"frames are limited to {self.max_frame} bytes", close_code=4400
            )
            return
        try:
            if text_data is not None:
                try:
                    message = json.loads(text_data)
                except (ValueError, RecursionError):  # not JSON, or nested past the stack
                    raise BadFrame("frames must be JSON objects") from None
                if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                    raise BadFrame("frames must be JSON objects with a string 'type'", "type")
                if message["type"] == "ping":
                    await self.send_json({"type": "pong"})
                    return
                await self.on_message(message)
            else:
                await self.on_binary(bytes_data or b"")
        except BadFrame as exc:
            await self.fail(
                "bad_frame",
                exc.message,
                field=exc.field,
                close_code=4400 if self.close_on_bad_frame else None,
            )
        except Exception:
            log.exception("websocket message failed")
            await self.fail("internal_error", "internal error", close_code=4500)

    async def on_message(self, message: dict[str, Any]) -> None:
        raise BadFrame(f"unknown frame type {message['type']!r}", "type")

    async def on_binary(self, data: bytes) -> None:
        raise BadFrame("binary frames are not accepted here")

    def _within_rate(self) -> bool:
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self._window_start, self._window_count = now, 0
        self._window_count += 1
        return self._window_count <= settings.HEDGEROW_WS_MAX_MESSAGES_PER_S

    async def send_json(self, obj: dict[str, Any]) -> None:
        if not self.closed:
            await self.send(text_data=json.dumps(obj, separators=(",", ":"), default=str))

    async def fail(
        self,
        code: str,
        message: str,
        *,
        field: str | None = None,
        close_code: int | None = None,
        **extra: Any,
    ) -> None:
        await self.send_json(
            {"type": "error", "code": code, "message": message, "field": field, **extra}
        )
        if close_code is not None:
            await self.close_with(close_code)

    async def close_with(self, code: int = 1000) -> None:
        if not self.closed:
            self.closed = True
            await self.close(code=code)
