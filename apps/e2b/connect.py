"""The Connect protocol (connectrpc.com/docs/protocol), JSON codec, server side.

What envd speaks and the E2B SDK sends: unary calls are ``application/json`` bodies
answered with JSON (an error is an HTTP status and ``{"code", "message"}``); server
streams are ``application/connect+json`` envelopes (1 flag byte, 4-byte big-endian
length, the message) ended by an end-of-stream envelope (flag 0x02) holding ``{}`` or
``{"error": {…}}``, always under HTTP 200. Only the JSON codec is spoken: the SDK uses
nothing else (its ``_ProtoJSONCodec``), so no protobuf runtime is needed here. The
messages are the proto3 JSON mapping: camelCase names, bytes in base64.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from django.http import HttpRequest, JsonResponse

from apps.core.errors import ApiError

END_STREAM = 0x02
COMPRESSED = 0x01
MAX_MESSAGE = 64 * 1024 * 1024 + 64 * 1024
STREAM_CONTENT_TYPE = "application/connect+json"

# HTTP status of a Hedgerow error → Connect code (and back, for unary answers).
_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    408: "deadline_exceeded",
    409: "failed_precondition",
    413: "resource_exhausted",
    429: "resource_exhausted",
    501: "unimplemented",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
}
_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "already_exists": 409,
    "failed_precondition": 400,
    "deadline_exceeded": 504,
    "resource_exhausted": 429,
    "unimplemented": 501,
    "unavailable": 503,
    "internal": 500,
}


class ConnectError(ApiError):
    """An error with an explicit Connect code (``not_found``, ``deadline_exceeded``…)."""

    def __init__(self, connect_code: str, message: str) -> None:
        super().__init__(message, code=connect_code, status_code=_STATUS.get(connect_code, 500))
        self.connect_code = connect_code


def code_of(exc: ApiError) -> str:
    if isinstance(exc, ConnectError):
        return exc.connect_code
    return _CODES.get(exc.status_code, "internal")


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"code": code_of(exc), "message": exc.message}


def unary_error(exc: ApiError) -> JsonResponse:
    status = _STATUS.get(code_of(exc), 500)
    return JsonResponse(error_body(exc), status=status)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(exc: ApiError | None = None) -> bytes:
    return envelope({"error": error_body(exc)} if exc is not None else {}, END_STREAM)


def read_unary(request: HttpRequest) -> dict[str, Any]:
    raw = request.read(MAX_MESSAGE + 1)
    if len(raw) > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", "the message is too large")
    return decode_json_message(raw)


def read_client_stream(request: HttpRequest) -> list[dict[str, Any]]:
    """Every message of a client-streaming call's body (envelopes back to back; Django
    has the whole body before the view runs, so they are all here)."""
    raw = request.read(MAX_MESSAGE + 6)
    if len(raw) > MAX_MESSAGE + 5:
        raise ConnectError("resource_exhausted", "the stream is too large")
    messages: list[dict[str, Any]] = []
    offset = 0
    while offset < len(raw):
        if len(raw) - offset < 5:
            raise ConnectError("invalid_argument", "a truncated Connect envelope")
        flags, length = struct.unpack(">BI", raw[offset : offset + 5])
        if flags & COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages are not accepted")
        body = raw[offset + 5 : offset + 5 + length]
        if len(body) != length:
            raise ConnectError("invalid_argument", "the envelope's length does not match")
        offset += 5 + length
        if flags & END_STREAM:
            break
        messages.append(decode_json_message(body))
    return messages


def read_stream_request(request: HttpRequest) -> dict[str, Any]:
    """The one message of a server-streaming call's request body (an envelope)."""
    raw = request.read(MAX_MESSAGE + 6)
    if len(raw) < 5:
        raise ConnectError("invalid_argument", "the request body is not a Connect envelope")
    flags, length = struct.unpack(">BI", raw[:5])
    if flags & COMPRESSED:
        raise ConnectError("unimplemented", "compressed messages are not accepted")
    if length > MAX_MESSAGE or len(raw) != 5 + length:
        raise ConnectError("invalid_argument", "the envelope's length does not match its body")
    return decode_json_message(raw[5:])


def decode_json_message(raw: bytes) -> dict[str, Any]:
    """One Connect message in the JSON codec (the only one the SDK sends): an object, or
    a typed ``invalid_argument``."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConnectError("invalid_argument", "the message is not JSON") from None
    if not isinstance(data, dict):
        raise ConnectError("invalid_argument", "the message must be a JSON object")
    return data


def timeout_s(request: HttpRequest) -> float | None:
    """The call's deadline (``Connect-Timeout-Ms``) in seconds, None when unbounded."""
    raw = request.headers.get("Connect-Timeout-Ms", "")
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 10:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be up to 10 digits")
    return int(raw) / 1000.0
