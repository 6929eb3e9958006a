"""Keep-alive HTTP/1.1 for the SDK's small JSON calls (``Sandbox.exec``, ``get``,
``delete``, heartbeats: a JSON body or none, a JSON answer).

httpx spends ~1.5–2 ms of client CPU per call on this path (URL merging and
validation, header models, the h11 state machine, a head and a body written as two
TCP segments) — as much as the exec itself costs the server. Here one call is the
request head and body in one write on a pooled keep-alive socket, the response head
split on CRLF, a Content-Length (or chunked) body: the lean client of
``bench/exec_latency.py``. Everything else (params, extra headers, streamed bodies,
event hooks, a replaced transport) stays on httpx; ``Client._send`` decides.

Behaviour is httpx's where a caller can see it: failures are ``httpx.TransportError``
subclasses with httpx's wording (so ``Client.request`` retries and reports them the
same way), timeouts are per socket operation, an idle connection the server closed is
dropped before reuse (never a request sent into it), the answer is an
``httpx.Response``. ``https`` uses httpx's own SSL context (same CA bundle)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import socket
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import httpx

# A path sent as it is: ids, slashes and a plain query. Anything else (spaces,
# non-ASCII, dot segments) goes through httpx, which normalises and percent-encodes it.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9_.~/\-]*(\?[A-Za-z0-9_.~=&%\-]*)?\Z")
_HEAD_LIMIT = 64 * 1024

Head = Tuple[int, List[Tuple[str, str]], Dict[str, str]]


def plain_path(path: str) -> bool:
    """Whether ``path`` can go on the request line unchanged."""
    return bool(_PLAIN_PATH.match(path)) and "/." not in path


class _Target:
    """The fixed part of every request to one base URL."""

    def __init__(self, base_url: str, headers: Dict[str, str]) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default_port = self.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        fixed = {
            "Host": host if default_port else f"{host}:{self.port}",
            "Accept": "*/*",
            "Connection": "keep-alive",
            **headers,
        }
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self.ssl = httpx.create_ssl_context() if self.tls else None

    def encode(self, method: str, path: str, body: Any) -> bytes:
        if body is None:
            # as httpx: a bodiless POST/PUT/PATCH says Content-Length: 0
            length = "Content-Length: 0\r\n" if method in ("POST", "PUT", "PATCH") else ""
            line = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.fixed}{length}\r\n"
            return line.encode("latin-1")
        # as httpx encodes json= (compact, UTF-8, NaN refused)
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        data = payload.encode()
        return (
            f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.fixed}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode("latin-1") + data


def _parse_head(raw: bytes) -> Head:
    """(status, header list, lower-cased header dict) of a response head."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line: {lines[0][:80]!r}")
    pairs: List[Tuple[str, str]] = []
    index: Dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise httpx.RemoteProtocolError(f"malformed header line: {line[:80]!r}")
        name, value = name.strip(), value.strip()
        pairs.append((name, value))
        index[name.lower()] = value
    if parts[0] == "HTTP/1.0" and index.get("connection", "").lower() != "keep-alive":
        index["connection"] = "close"
    return int(parts[1]), pairs, index


def _reusable(sock: socket.socket) -> bool:
    """An idle keep-alive connection is reusable unless something arrived on it: the
    server's close (EOF) or bytes nobody asked for."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _transport_error(exc: BaseException, *, connecting: bool, reading: bool) -> httpx.HTTPError:
    """The httpx exception httpcore raises for the same failure."""
    if isinstance(exc, httpx.TransportError):
        return exc
    message = str(exc)
    if isinstance(exc, (socket.timeout, asyncio.TimeoutError, TimeoutError)):
        if connecting:
            return httpx.ConnectTimeout(message or "timed out")
        return (httpx.ReadTimeout if reading else httpx.WriteTimeout)(message or "timed out")
    if connecting:
        return httpx.ConnectError(message)
    return (httpx.ReadError if reading else httpx.WriteError)(message)


_DISCONNECTED = "Server disconnected without sending a response."


class LeanPool:
    """Keep-alive connections for one client, shared by its threads (each call takes
    an idle connection or opens one; at most ``limit`` in use, more go to httpx)."""

    def __init__(self, base_url: str, headers: Dict[str, str], limit: int = 100) -> None:
        self.target = _Target(base_url, headers)
        self.limit = limit
        self._idle: List[socket.socket] = []
        self._in_use = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def full(self) -> bool:
        return self._in_use >= self.limit

    def request(self, method: str, path: str, body: Any, timeout: float) -> httpx.Response:
        data = self.target.encode(method, path, body)
        sock = self._checkout(timeout)
        done = False
        try:
            sock.settimeout(timeout)
            try:
                sock.sendall(data)
            except OSError as exc:
                raise _transport_error(exc, connecting=False, reading=False) from exc
            try:
                status, pairs, content, keep = self._read(sock)
            except OSError as exc:
                raise _transport_error(exc, connecting=False, reading=True) from exc
            done = keep
        finally:
            self._checkin(sock, done)
        return httpx.Response(status, headers=pairs, content=content)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _checkout(self, timeout: float) -> socket.socket:
        with self._lock:
            if self._pid != os.getpid():
                # a forked child: the parent's connections are the parent's (closing our
                # copies of their fds leaves them open there)
                self._pid = os.getpid()
                for sock in self._idle:
                    sock.close()
                self._idle, self._in_use = [], 0
            self._in_use += 1
            while self._idle:
                sock = self._idle.pop()
                if _reusable(sock):
                    return sock
                sock.close()
        try:
            return self._connect(timeout)
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise

    def _connect(self, timeout: float) -> socket.socket:
        target = self.target
        try:
            sock = socket.create_connection((target.host, target.port), timeout=timeout)
        except OSError as exc:
            raise _transport_error(exc, connecting=True, reading=False) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if target.ssl is not None:
            try:
                sock = target.ssl.wrap_socket(sock, server_hostname=target.host)
            except OSError as exc:
                sock.close()
                raise _transport_error(exc, connecting=True, reading=False) from exc
        return sock

    def _checkin(self, sock: socket.socket, keep: bool) -> None:
        with self._lock:
            self._in_use -= 1
            if keep:
                self._idle.append(sock)
                return
        sock.close()

    @staticmethod
    def _read(sock: socket.socket) -> Tuple[int, List[Tuple[str, str]], bytes, bool]:
        buf = b""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > _HEAD_LIMIT:
                raise httpx.RemoteProtocolError("response head too large")
            chunk = sock.recv(65536)
            if not chunk:
                raise httpx.RemoteProtocolError(_DISCONNECTED)
            buf += chunk
        status, pairs, index = _parse_head(buf[:end])
        buf = buf[end + 4 :]
        if status < 200:  # 1xx: the SDK never asks for one (no Expect: 100-continue)
            raise httpx.RemoteProtocolError(f"unexpected informational response {status}")
        keep = index.get("connection", "").lower() != "close"
        if "chunked" in index.get("transfer-encoding", "").lower():
            body, rest = _dechunk(sock, buf)
            return status, _plain(pairs), body, keep and not rest
        if "content-length" in index:
            length = int(index["content-length"])
            parts = [buf]
            have = len(buf)
            while have < length:
                chunk = sock.recv(max(65536, length - have))
                if not chunk:
                    raise httpx.RemoteProtocolError(_DISCONNECTED)
                parts.append(chunk)
                have += len(chunk)
            raw = b"".join(parts)
            return status, pairs, raw[:length], keep and have == length
        if status in (204, 304):
            return status, pairs, b"", keep and not buf
        # no length: the body ends with the connection
        parts = [buf]
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return status, pairs, b"".join(parts), False
            parts.append(chunk)


def _plain(pairs: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """The headers of a de-chunked body (httpx.Response is given the whole content)."""
    return [(k, v) for k, v in pairs if k.lower() != "transfer-encoding"]


def _dechunk(sock: socket.socket, buf: bytes) -> Tuple[bytes, bytes]:
    """A chunked body from ``buf`` and the socket: (body, bytes left over)."""
    body: List[bytes] = []
    while True:
        while b"\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise httpx.RemoteProtocolError(_DISCONNECTED)
            buf += chunk
        size_line, _, buf = buf.partition(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise httpx.RemoteProtocolError("malformed chunk size") from None
        while len(buf) < size + 2:
            chunk = sock.recv(65536)
            if not chunk:
                raise httpx.RemoteProtocolError(_DISCONNECTED)
            buf += chunk
        if size == 0:
            # trailers (none expected) end with an empty line
            while not (buf.startswith(b"\r\n") or b"\r\n\r\n" in buf):
                chunk = sock.recv(65536)
                if not chunk:
                    raise httpx.RemoteProtocolError(_DISCONNECTED)
                buf += chunk
            rest = buf[2:] if buf.startswith(b"\r\n") else buf.split(b"\r\n\r\n", 1)[1]
            return b"".join(body), rest
        body.append(buf[:size])
        buf = buf[size + 2 :]


_Conn = Tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.AbstractEventLoop]


class AsyncLeanPool:
    """``LeanPool`` for asyncio: connections belong to the loop that opened them (a
    client used from a later ``asyncio.run`` opens new ones)."""

    def __init__(self, base_url: str, headers: Dict[str, str], limit: int = 100) -> None:
        self.target = _Target(base_url, headers)
        self.limit = limit
        self._idle: List[_Conn] = []
        self._in_use = 0

    def full(self) -> bool:
        return self._in_use >= self.limit

    async def request(self, method: str, path: str, body: Any, timeout: float) -> httpx.Response:
        data = self.target.encode(method, path, body)
        self._in_use += 1
        conn: Optional[_Conn] = None
        keep = False
        try:
            conn = await self._checkout(timeout)
            reader, writer, _ = conn
            try:
                if sys.version_info >= (3, 11):
                    # no task per call, as wait_for makes one before 3.12
                    async with asyncio.timeout(timeout):
                        status, pairs, content, keep = await self._exchange(reader, writer, data)
                else:  # pragma: no cover - Python < 3.11
                    status, pairs, content, keep = await asyncio.wait_for(
                        self._exchange(reader, writer, data), timeout
                    )
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                if isinstance(exc, asyncio.IncompleteReadError):
                    raise httpx.RemoteProtocolError(_DISCONNECTED) from exc
                raise _transport_error(exc, connecting=False, reading=True) from exc
            except asyncio.LimitOverrunError as exc:
                raise httpx.RemoteProtocolError("response head too large") from exc
        finally:
            self._in_use -= 1
            if conn is not None:
                if keep:
                    self._idle.append(conn)
                else:
                    conn[1].close()
        return httpx.Response(status, headers=pairs, content=content)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer, _ in idle:
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                writer.close()

    async def _checkout(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        while self._idle:
            conn = self._idle.pop()
            sock = conn[1].get_extra_info("socket")
            if conn[2] is loop and not conn[0].at_eof() and sock is not None and _reusable(sock):
                return conn
            if conn[2] is loop:
                conn[1].close()
        target = self.target
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    target.host,
                    target.port,
                    ssl=target.ssl,
                    server_hostname=target.host if target.ssl is not None else None,
                    limit=_HEAD_LIMIT,
                ),
                timeout,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc, connecting=True, reading=False) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer, loop

    @staticmethod
    async def _exchange(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
    ) -> Tuple[int, List[Tuple[str, str]], bytes, bool]:
        writer.write(data)
        raw = await reader.readuntil(b"\r\n\r\n")
        status, pairs, index = _parse_head(raw[:-4])
        if status < 200:
            raise httpx.RemoteProtocolError(f"unexpected informational response {status}")
        keep = index.get("connection", "").lower() != "close"
        if "chunked" in index.get("transfer-encoding", "").lower():
            body: List[bytes] = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise httpx.RemoteProtocolError("malformed chunk size") from None
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailers
                    return status, _plain(pairs), b"".join(body), keep
                body.append((await reader.readexactly(size + 2))[:size])
        if "content-length" in index:
            return status, pairs, await reader.readexactly(int(index["content-length"])), keep
        if status in (204, 304):
            return status, pairs, b"", keep
        return status, pairs, await reader.read(), False
