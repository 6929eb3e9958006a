"""What the API's ASGI fast paths (exec_fastpath, files_fastpath) answer with, built
once: the headers Django's middleware and DRF put on an APIView's JSON answer, DRF's
JSON rendering, the response's two ASGI messages and RequestIdMiddleware's access line.
Each fast path must answer byte-for-byte what its Django view would
(apps/sandboxes/tests/test_exec_fastpath.py compares them)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from apps.core.asgi_body import Send
from apps.core.logging import request_id_var

access_log = logging.getLogger("hedgerow.access")

ASGIApp = Callable[..., Awaitable[None]]
# An X-Request-Id a client may choose (RequestIdMiddleware's rule); others get a new one.
VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")

# What SecurityMiddleware adds after the view's own headers.
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


def view_headers(allow: bytes) -> list[tuple[bytes, bytes]]:
    """What DRF's APIView (Allow, Vary) and XFrameOptionsMiddleware put on a JSON
    answer of a view that allows the methods ``allow``."""
    return [
        (b"content-type", b"application/json"),
        (b"vary", b"Accept"),
        (b"allow", allow),
        (b"x-frame-options", b"DENY"),
    ]


def json_bytes(data: Any) -> bytes:
    """DRF's JSONRenderer with this project's settings (compact, UTF-8, strict)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").encode()


async def send_json(
    send: Send,
    view: list[tuple[bytes, bytes]],
    status: int,
    payload: bytes,
    request_id: str,
    extra: dict[str, str],
) -> None:
    """The whole answer: the view's headers, length, request id, an error's own headers
    (as the API's exception handler passes them on), then SecurityMiddleware's."""
    headers = [
        *view,
        (b"content-length", str(len(payload)).encode()),
        (b"x-request-id", request_id.encode()),
        *(
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in extra.items()
        ),
        *SECURITY_HEADERS,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def log_access(method: str, path: str, status: int, request_id: str, started: float) -> None:
    """The same structured line as RequestIdMiddleware (the web end of a trace)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    token = request_id_var.set(request_id)
    try:
        access_log.info(
            "%s %s %s",
            method,
            path,
            status,
            extra={
                "event": "request",
                "method": method,
                "path": path,
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
            },
        )
    finally:
        request_id_var.reset(token)
