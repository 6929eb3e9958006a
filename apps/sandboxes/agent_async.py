"""The exec hot path's agent call on the event loop: a minimal HTTP/1.1 client over
pooled keep-alive asyncio streams.

Why not httpx.AsyncClient: on the hot path its per-call CPU (≈0.8 ms) is more than
the rest of the control plane's work; the agent speaks plain HTTP/1.1 with a
Content-Length (or chunked) body, which needs a few lines, not a library.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from apps.sandboxes.agent_client import AgentUnreachable, raise_for_agent_status

IDLE_S = 30.0
PER_AGENT = 32
MAX_RESPONSE = 256 << 20

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# (host, port) → idle connections with the time they were returned, most recent last.
_idle: dict[tuple[str, int], list[tuple[_Conn, float]]] = {}


_loop: list[asyncio.AbstractEventLoop | None] = [None]


def _take(host: str, port: int) -> _Conn | None:
    loop = asyncio.get_running_loop()
    if _loop[0] is not loop:
        # Streams belong to the loop that made them (tests run a loop per test).
        pool_clear()
        _loop[0] = loop
    idle = _idle.get((host, port))
    now = time.monotonic()
    while idle:
        conn, since = idle.pop()
        if now - since < IDLE_S and not conn[1].is_closing() and not conn[0].at_eof():
            return conn
        conn[1].close()
    return None


def _give(host: str, port: int, conn: _Conn) -> None:
    idle = _idle.setdefault((host, port), [])
    if len(idle) < PER_AGENT:
        idle.append((conn, time.monotonic()))
    else:
        conn[1].close()


def pool_clear() -> None:
    """Closes every idle connection (tests; a loop that is going away)."""
    for conns in _idle.values():
        for (_reader, writer), _since in conns:
            with contextlib.suppress(RuntimeError):  # that loop is closed already
                writer.close()
    _idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, connection stays open)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = headers.get("connection", "").lower() != "close"
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts: list[bytes] = []
        size_total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            size_total += size
            if size_total > MAX_RESPONSE:
                raise AgentUnreachable("agent response too large")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return status, b"".join(parts), keep
    length = int(headers.get("content-length", "-1"))
    if length < 0:
        return status, await reader.read(MAX_RESPONSE), False
    if length > MAX_RESPONSE:
        raise AgentUnreachable("agent response too large")
    return status, await reader.readexactly(length), keep


async def agent_exec(
    host: str, port: int, token: str, body: dict[str, Any], *, timeout: float, request_id: str
) -> dict[str, Any]:
    """POST /exec to the agent; the parsed result, or AgentError / AgentUnreachable like
    ``AgentClient.exec``. A reused connection the agent closed meanwhile is retried once
    on a fresh one: safe, because the operation id makes the agent attach, not rerun."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /exec HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        + (f"X-Request-Id: {request_id}\r\n" if request_id else "")
        + "\r\n"
    ).encode("latin-1")
    base = f"http://{host}:{port}"
    for attempt in (0, 1):
        conn = _take(host, port)
        reused = conn is not None
        try:
            async with asyncio.timeout(timeout):
                if conn is None:
                    conn = await asyncio.open_connection(host, port)
                reader, writer = conn
                writer.write(head + payload)
                status, data, keep = await _read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            if conn is not None:
                conn[1].close()
            if reused and attempt == 0:
                continue
            raise AgentUnreachable(f"agent at {base} unreachable: {exc!r}") from exc
        except (OSError, TimeoutError, ValueError, IndexError, asyncio.LimitOverrunError) as exc:
            if conn is not None:
                conn[1].close()
            raise AgentUnreachable(f"agent at {base} unreachable: {exc!r}") from exc
        except BaseException:
            # Cancelled mid-request (client went away): the connection's state is unknown.
            if conn is not None:
                conn[1].close()
            raise
        if keep:
            _give(host, port, conn)
        else:
            conn[1].close()
        raise_for_agent_status(status, data)
        result: dict[str, Any] = json.loads(data)
        return result
    raise AssertionError("unreachable")
