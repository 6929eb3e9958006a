"""envd's ``process.Process/StreamInput`` (``commands.stream_input``), served chunk by
chunk on the event loop.

A Connect client stream: a ``start`` message naming the process, then ``data``
messages (``{"input": {"stdin": base64}}``) and ``keepalive``s, in one request body the
SDK sends as its iterable yields. Django reads a request's whole body before a view
runs, so the regular view could pass input on only once the client had sent all of
it; here each envelope is read from the ASGI ``receive`` as it arrives and its input
goes to the running command (``process_send_input``: Hedgerow's
``operation_send_stdin``, in order, at most 1 MiB unread) before the next one is read.
The answer is the regular one: one empty message and the end of the stream, or the
end of the stream with the typed error (the rest of the body is read first, so the
client always gets the answer rather than a broken pipe).
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http.request import split_domain_port, validate_host
from django.utils.datastructures import CaseInsensitiveMapping

from apps.core.asgi_body import Receive, Scope, Send
from apps.core.errors import ApiError
from apps.core.logging import request_id_var
from apps.e2b import connect, process
from apps.e2b.connect import ConnectError
from apps.e2b.envd import envd_sandbox
from apps.sandboxes.models import Operation

PATH = "/e2b/envd/process.Process/StreamInput"

access_log = logging.getLogger("hedgerow.access")


class _Request:
    """What ``envd_sandbox`` reads of a request: its headers."""

    def __init__(self, scope: Scope) -> None:
        self.headers = CaseInsensitiveMapping(
            {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        )


async def _envelopes(receive: Receive) -> AsyncIterator[tuple[int, bytes]]:
    """(flags, message) of each envelope as soon as the whole of it has arrived."""
    pending = bytearray()
    more = True
    while True:
        while len(pending) >= 5:
            flags, length = struct.unpack(">BI", pending[:5])
            if length > connect.MAX_MESSAGE:
                raise ConnectError("resource_exhausted", "the message is too large")
            if len(pending) < 5 + length:
                break
            message = bytes(pending[5 : 5 + length])
            del pending[: 5 + length]
            yield flags, message
        if not more:
            if pending:
                raise ConnectError("invalid_argument", "a truncated Connect envelope")
            return
        event = await receive()
        if event["type"] == "http.disconnect":
            raise ConnectError("unavailable", "the client went away")
        pending += event.get("body", b"")
        more = bool(event.get("more_body", False))


def _open(request: _Request, selector: Any) -> Operation:
    try:
        _, sandbox = envd_sandbox(request, "write")  # type: ignore[arg-type]
        return process.operation_for_pid(sandbox=sandbox, selector=selector)
    finally:
        close_old_connections()


def _send(operation: Operation, data: Any) -> None:
    try:
        process.process_send_input(operation=operation, data=data)
    finally:
        close_old_connections()


async def _feed(scope: Scope, envelopes: AsyncIterator[tuple[int, bytes]]) -> None:
    operation: Operation | None = None
    async for flags, raw in envelopes:
        if flags & connect.COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages are not accepted")
        if flags & connect.END_STREAM:
            break
        message = connect.decode_json_message(raw)
        if operation is None:
            if not isinstance(message.get("start"), dict):
                raise ConnectError("invalid_argument", "the stream must begin with a start event")
            request = _Request(scope)
            operation = await sync_to_async(_open, thread_sensitive=False)(
                request, message["start"].get("process")
            )
            continue
        if "keepalive" in message:
            continue
        data = message.get("data")
        if not isinstance(data, dict):
            raise ConnectError("invalid_argument", "expected a data or keepalive event")
        # In order: the next envelope is read once this input reached the command.
        await sync_to_async(_send, thread_sensitive=False)(operation, data.get("input"))
    if operation is None:
        raise ConnectError("invalid_argument", "the stream must begin with a start event")


def _host_allowed(scope: Scope) -> bool:
    if settings.ALLOWED_HOSTS == ["*"]:
        return True
    host = next((v for n, v in scope["headers"] if n == b"host"), b"").decode("latin-1")
    domain, _port = split_domain_port(host)
    return bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)


async def serve(scope: Scope, receive: Receive, send: Send) -> bool:
    """Answers a StreamInput call; False (nothing read or sent) when Django should,
    for a Host it would refuse."""
    if not _host_allowed(scope):
        return False
    started = time.perf_counter()
    request_id = uuid.uuid4().hex
    token = request_id_var.set(request_id)
    try:
        envelopes = _envelopes(receive)
        try:
            await _feed(scope, envelopes)
            body = connect.envelope({}) + connect.end_stream()
        except ApiError as exc:
            body = connect.end_stream(exc)
            try:  # the rest of the body, so the client reads the answer
                async for _ in envelopes:
                    pass
            except ApiError:
                pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", connect.STREAM_CONTENT_TYPE.encode()),
                    (b"cache-control", b"no-store"),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-request-id", request_id.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                "POST %s 200",
                PATH,
                extra={
                    "event": "request",
                    "method": "POST",
                    "path": PATH,
                    "status": 200,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                },
            )
    finally:
        request_id_var.reset(token)
    return True
