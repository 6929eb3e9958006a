"""A minimal asyncio HTTP/1.1 keep-alive client for the load generators.

The benchmark client runs on the same two cores as the server it measures; with httpx
it spent ~100 ms of CPU per sandbox lifecycle (7 requests), as much as the web process
answering them. This one does only what the benchmarks need — JSON in, JSON out,
Content-Length or chunked bodies, a pool of keep-alive connections — in a few
function calls per request.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from typing import Any
from urllib.parse import urlencode, urlsplit


class TransportError(Exception):
    """The connection failed before a whole response arrived."""


class Response:
    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Client:
    """``await client.request("POST", "/sandboxes", json={...}, headers={...})``.

    Paths are relative to ``base_url``'s path. A request that fails on a pooled
    connection before any byte of the answer arrived (the server closed it while idle)
    is sent once more on a new connection and counted in ``reconnects``; every other
    transport failure raises ``TransportError`` for the caller's retry policy.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        fixed = {"Host": f"{self.host}:{self.port}", **(headers or {})}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Conn] = []
        self.reconnects = 0

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Response:
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        body = b"" if json is None else jsonlib.dumps(json).encode()
        head = f"{method} {target} HTTP/1.1\r\n{self._fixed}"
        if headers:
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if json is not None:
            head += "Content-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        payload = head.encode() + body
        while self._idle:
            conn = self._idle.pop()
            if conn[0].at_eof() or conn[1].is_closing():
                conn[1].close()
                continue
            try:
                return await self._exchange(conn, payload)
            except _NothingReceived:
                self.reconnects += 1  # closed while idle; try a fresh connection
                break
        try:
            conn = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            raise TransportError(f"connect: {exc}") from exc
        try:
            return await self._exchange(conn, payload)
        except _NothingReceived as exc:
            raise TransportError(str(exc)) from exc

    async def _exchange(self, conn: _Conn, payload: bytes) -> Response:
        reader, writer = conn
        try:
            writer.write(payload)
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _NothingReceived("connection closed before the answer") from exc
                raise
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers: dict[str, str] = {}
            for row in lines[1:]:
                if row:
                    name, _, value = row.partition(":")
                    headers[name.strip().lower()] = value.strip()
            if "content-length" in headers:
                content = await reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                content = await _read_chunked(reader)
            else:
                content = await reader.read()
                headers["connection"] = "close"
        except _NothingReceived:
            writer.close()
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            if isinstance(exc, ConnectionResetError | BrokenPipeError):
                raise _NothingReceived(str(exc)) from exc
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append(conn)
        return Response(status, headers, content)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()


class _NothingReceived(TransportError):
    pass


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers from our servers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
