"""The REST exec hot path in front of Django: ``POST /api/v1/sandboxes/<id>/exec``
answered on the event loop (``operation_exec_async``) when the request is the plain
case, byte-for-byte what ``ExecView`` answers.

Why in front of Django and not an async view: under ASGI every sync view, and every
sync-only middleware, costs a hop into a thread, and DRF's request/serializer/renderer
machinery on top was most of the control plane's CPU per exec on 2 shared cores.

Everything this path does not handle exactly goes to Django unchanged (the body is
replayed): session auth, a key this process never cached (a stale one is looked up again,
once for all concurrent execs), one that no longer authenticates, a missing scope,
any body the strict check below does not accept (DRF then gives the precise
validation error), ``stream: true``, content negotiation other than JSON, a query
string, a disallowed Host, and whatever ``operation_exec_async`` returns FALLBACK for.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from django.conf import settings
from django.http.request import split_domain_port, validate_host

from apps.billing.limits import exec_kind
from apps.core.asgi_body import Receive, Scope, Send, read_body, replay
from apps.core.errors import ApiError, _internal_error_body
from apps.core.inputs import json_loads
from apps.core.logging import request_id_var
from apps.sandboxes.api import transfer_gate
from apps.sandboxes.api.fastpath_response import (
    VALID_REQUEST_ID,
    ASGIApp,
    json_bytes,
    log_access,
    send_json,
    view_headers,
)
from apps.sandboxes.api.serializers import render_stream
from apps.sandboxes.services.exec_async import iso, operation_exec_async, single_flight
from apps.sandboxes.services.operations import ExecRequest, _agent_timeout
from apps.tenancy.auth import principal_cached, principal_refresh
from apps.tenancy.principal import Principal
from apps.tenancy.secrets import hash_secret

log = logging.getLogger(__name__)

_PATH = re.compile(r"/api/v1/sandboxes/([^/]+)/exec")
_OPERATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_BODY = 64 * 1024
_WANTED = {b"authorization", b"x-api-key", b"content-type", b"accept", b"x-request-id", b"host"}
# What Django's middleware and DRF add to ExecView's answer (SecurityMiddleware,
# XFrameOptionsMiddleware, the APIView's Allow and Vary).
_HEADERS = view_headers(b"POST, OPTIONS")


class ExecFastPath:
    """ASGI middleware: plain REST execs here, everything else to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and not scope.get("query_string")
        ):
            match = _PATH.fullmatch(scope["path"])
        if match is None or not settings.HEDGEROW_EXEC_FAST_PATH:
            await self.app(scope, receive, send)
            return
        body, complete = await read_body(receive, MAX_BODY)
        if complete:
            started = time.perf_counter()
            answer = await _answer(scope, match.group(1), body)
            if answer is not None:
                status, payload, request_id, extra_headers = answer
                await send_json(send, _HEADERS, status, payload, request_id, extra_headers)
                log_access("POST", scope["path"], status, request_id, started)
                return
        await self.app(scope, replay(body, complete, receive), send)


_Answer = tuple[int, bytes, str, dict[str, str]]


async def _answer(scope: Scope, sandbox_id: str, body: bytes) -> _Answer | None:
    """(status, JSON body, request id, the error's own headers such as Retry-After), or
    None for Django to answer."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            if name in headers:
                return None  # repeated headers: Django's joining rules apply
            headers[name] = value
    if not _acceptable(headers):
        return None
    secret = _key(headers)
    if not secret:
        return None
    principal = principal_cached(secret)
    if principal is None:
        principal = await _refreshed_principal(secret)
    if principal is None or not principal.has_scope("write"):
        return None
    parsed = parse_exec_body(body)
    if parsed is None:
        return None
    request, operation_id, generation = parsed
    incoming = headers.get(b"x-request-id", b"").decode("latin-1")
    request_id = incoming if VALID_REQUEST_ID.match(incoming) else uuid.uuid4().hex
    token = request_id_var.set(request_id)
    short = exec_kind(_agent_timeout(request)) == "exec"
    try:
        with transfer_gate.short_work(short):  # transfers in this process yield to it
            fields = await operation_exec_async(
                principal=principal,
                sandbox_external_id=sandbox_id,
                request=request,
                operation_id=operation_id,
                expected_generation=generation,
                request_id=request_id,
            )
    except ApiError as exc:
        return exc.status_code, json_bytes(exc.as_dict()), request_id, exc.headers
    except Exception:
        # As the API's exception handler does: logged with its traceback, answered in
        # the envelope with the request id to quote, no internals.
        log.exception("unhandled error in the exec fast path")
        return 500, json_bytes(_internal_error_body()), request_id, {}
    finally:
        request_id_var.reset(token)
    if fields is None:
        return None
    return 200, render_operation(fields), request_id, {}


async def _refreshed_principal(secret: str) -> Principal | None:
    """A key whose cache entry went stale, looked up again once for all the execs that
    arrive meanwhile; None (the regular path answers) for a key this process never
    cached or one that no longer authenticates."""
    try:
        return await single_flight(f"key:{hash_secret(secret)}", principal_refresh, secret)
    except Exception:  # noqa: BLE001 - the regular path answers (and reports) it
        log.warning("exec fast path: key lookup failed", exc_info=True)
        return None


def _acceptable(headers: dict[bytes, bytes]) -> bool:
    """JSON in, JSON out, an allowed Host: what DRF would parse and render the same."""
    ctype = headers.get(b"content-type", b"").decode("latin-1").lower().replace(" ", "")
    if ctype not in ("application/json", "application/json;charset=utf-8"):
        return False
    if headers.get(b"accept", b"*/*").strip() not in (b"*/*", b"application/json"):
        return False
    if settings.ALLOWED_HOSTS != ["*"]:
        domain, _port = split_domain_port(headers.get(b"host", b"").decode("latin-1"))
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return False
    return True


def _key(headers: dict[bytes, bytes]) -> str | None:
    """As ``extract_key``: ``Authorization: Bearer`` first, else ``X-API-Key``."""
    header = headers.get(b"authorization", b"").decode("latin-1")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return headers.get(b"x-api-key", b"").decode("latin-1").strip() or None


def _text(value: Any) -> bool:
    """A string DRF's CharField keeps as is (no trimming, not blank, no NUL/surrogates)."""
    if not isinstance(value, str) or not value or value != value.strip() or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number(value: Any, low: float, high: float | None) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and value == value
        and value >= low
        and (high is None or value <= high)
    )


_FIELDS = frozenset(
    {
        "command",
        "cwd",
        "env",
        "timeout",
        "stdin",
        "login_shell",
        "output_window",
        "output_limit",
        "operation_id",
        "generation",
        "stream",
    }
)


def parse_exec_body(body: bytes) -> tuple[ExecRequest, str | None, int | None] | None:
    """The exec body as ``ExecSerializer`` would validate it, or None unless this is a
    body it accepts with exactly these values (anything doubtful goes to DRF)."""
    if b"\\u0000" in body:
        return None  # a NUL somewhere (JSON must escape it): DRF names the field in its 400
    try:
        data = json_loads(body)  # depth and surrogates: DRF gives the typed error
    except ApiError:
        return None
    if not isinstance(data, dict) or not data.keys() <= _FIELDS or data.get("stream", False):
        return None
    command = data.get("command")
    if isinstance(command, str):
        if not command.strip():
            return None
    elif not (isinstance(command, list) and command and all(isinstance(a, str) for a in command)):
        return None
    cwd, env, stdin = data.get("cwd"), data.get("env", {}), data.get("stdin")
    if cwd is not None and not (_text(cwd) and cwd.startswith("/")):
        return None
    if not isinstance(env, dict) or not all(
        isinstance(v, str) and (v == "" or _text(v)) for v in env.values()
    ):
        return None
    if stdin is not None and not (_text(stdin) and _base64(stdin)):
        return None
    timeout = data.get("timeout")
    if timeout is not None and not _number(timeout, 0.01, 86400):
        return None
    window, limit = data.get("output_window"), data.get("output_limit")
    if window is not None and not (type(window) is int and 256 <= window <= 64 * 1024 * 1024):
        return None
    if limit is not None and not (type(limit) is int and limit >= 1):
        return None
    login_shell = data.get("login_shell", False)
    operation_id, generation = data.get("operation_id"), data.get("generation")
    if not isinstance(login_shell, bool) or data.get("stream", False) is not False:
        return None
    if operation_id is not None and not (
        isinstance(operation_id, str) and _OPERATION_ID.fullmatch(operation_id)
    ):
        return None
    if generation is not None and not (type(generation) is int and generation >= 0):
        return None
    request = ExecRequest(
        command=command,
        cwd=cwd,
        env=env,
        timeout=None if timeout is None else float(timeout),
        stdin_b64=stdin,
        login_shell=login_shell,
        output_window=window,
        output_limit=limit,
    )
    return request, operation_id, generation


def _base64(value: str) -> bool:
    import base64
    import binascii

    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def render_operation(fields: dict[str, Any]) -> bytes:
    """An operation as ``OperationSerializer`` + DRF's JSONRenderer render it."""
    stdout, stderr = fields["stdout"], fields["stderr"]
    return json_bytes(
        {
            "id": fields["operation_id"],
            "sandbox_id": fields["sandbox_external_id"],
            "generation": fields["generation"],
            "kind": fields["kind"],
            "status": str(fields["status"]),
            "termination": fields["termination"],
            "exit_code": fields["exit_code"],
            "signal": fields["signal"],
            "timed_out": fields["termination"] == "timeout",
            "stdout": render_stream(stdout),
            "stderr": render_stream(stderr),
            "output": {"stdout": stdout, "stderr": stderr},
            "usage": fields["usage"],
            "children_remained": fields["children_remained"],
            "error": fields["error"],
            "created_at": iso(fields["created_at"]),
            "finished_at": iso(fields["finished_at"]),
        }
    )
