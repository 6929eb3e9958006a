"""The exec hot path's Redis client: RESP2 over one pipelined asyncio connection per
event loop.

Why not ``redis.asyncio``: on the hot path its per-call CPU (argument encoding through
its Encoder, a pool checkout, a line-by-line parser, ~90 µs per pipeline here) was the
largest single item of the fast path's own work, paid twice per exec. The hot path
sends a handful of commands (EVALSHA/EVAL, SET, ZREM) and reads small replies, which
needs a packer and a parser of a few lines each.

One connection carries every concurrent caller: Redis answers in the order it was
written to, so each batch's replies are matched to the callers in write order. A
caller that gives up (cancelled) leaves its slot in the queue and its replies are read
and dropped. When the connection breaks, every waiting caller gets ``ConnectionError``
and the next call reconnects.

URLs other than ``redis://`` and ``unix://`` (TLS, or options this client does not
implement) get :class:`RedisPyBatches`, the same interface over ``redis.asyncio``.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Protocol, cast
from urllib.parse import unquote, urlsplit

import redis.asyncio

__all__ = ["Batches", "RedisBatches", "RedisPyBatches", "ReplyError", "batches_for_url"]


class ReplyError(Exception):
    """A Redis error reply (``-NOSCRIPT …``, ``-WRONGTYPE …``), given as a batch's value."""


class Batches(Protocol):
    """Runs commands in one round trip; each reply in order, error replies as
    exception instances (never raised). Raises ``OSError`` (``ConnectionError``) or
    ``redis.RedisError`` when the round trip itself failed."""

    async def run(self, *commands: tuple[Any, ...]) -> list[Any]: ...

    async def close(self) -> None: ...


class _Incomplete(Exception):
    pass


def _arg(value: Any) -> bytes:
    # As redis-py encodes arguments (its Encoder): numbers by repr, no bools.
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"cannot send {type(value).__name__} to Redis")


def pack(command: tuple[Any, ...]) -> bytes:
    packed = bytearray(b"*%d\r\n" % len(command))
    for value in command:
        kind = type(value)  # the common types inline: this runs ~25 times per exec
        if kind is str:
            data = value.encode()
        elif kind is int:
            data = b"%d" % value  # what repr gives for an int
        else:
            data = _arg(value)
        packed += b"$%d\r\n" % len(data)
        packed += data
        packed += b"\r\n"
    return bytes(packed)


def parse(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply at ``pos``: (value, position after it); ``_Incomplete`` when the
    buffer does not hold all of it yet. Strings stay bytes; an error is a ReplyError."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line, pos = buf[pos], bytes(buf[pos + 1 : end]), end + 2
    if kind == 0x3A:  # ':'
        return int(line), pos
    if kind == 0x2B:  # '+'
        return line, pos
    if kind == 0x2D:  # '-'
        return ReplyError(line.decode(errors="replace")), pos
    if kind == 0x24:  # '$'
        size = int(line)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise _Incomplete
        return bytes(buf[pos : pos + size]), pos + size + 2
    if kind == 0x2A:  # '*'
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    raise ValueError(f"not a RESP2 reply: {kind:#x}")


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        # (replies expected, replies so far, the caller's future), in write order.
        self.waiting: collections.deque[tuple[int, list[Any], asyncio.Future[list[Any]]]] = (
            collections.deque()
        )
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        pos = 0
        try:
            while self.buffer and pos < len(self.buffer):
                if not self.waiting:
                    raise ValueError("a Redis reply nobody asked for")
                value, pos_after = parse(self.buffer, pos)
                pos = pos_after
                expected, replies, future = self.waiting[0]
                replies.append(value)
                if len(replies) == expected:
                    self.waiting.popleft()
                    if not future.done():
                        future.set_result(replies)
        except _Incomplete:
            pass
        except ValueError as exc:
            self._fail(ConnectionError(f"Redis protocol error: {exc}"))
            if self.transport is not None:
                self.transport.abort()
            return
        del self.buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"Redis connection lost: {exc!r}"))

    def _fail(self, exc: Exception) -> None:
        self.lost = True
        while self.waiting:
            _expected, _replies, future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)

    def send(self, commands: tuple[tuple[Any, ...], ...]) -> asyncio.Future[list[Any]]:
        assert self.transport is not None
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self.waiting.append((len(commands), [], future))
        self.transport.write(b"".join([pack(c) for c in commands]))
        return future


class RedisBatches:
    """``Batches`` over one pipelined connection to a ``redis://`` or ``unix://`` URL."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.setup: list[tuple[Any, ...]] = []
        if password is not None:
            self.setup.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            self.setup.append(("SELECT", db))
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    async def run(self, *commands: tuple[Any, ...]) -> list[Any]:
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connect()
        return await conn.send(commands)

    async def _connect(self) -> _Connection:
        if self._connecting is not None:
            # Callers arriving while it connects share the one connection.
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            if self.path is not None:
                _t, conn = await loop.create_unix_connection(_Connection, self.path)
            else:
                _t, conn = await loop.create_connection(_Connection, self.host, self.port)
            if self.setup:
                for reply in await conn.send(tuple(self.setup)):
                    if isinstance(reply, ReplyError):
                        assert conn.transport is not None
                        conn.transport.close()
                        raise ConnectionError(f"Redis refused the connection setup: {reply}")
        except BaseException as exc:
            self._connecting.set_exception(exc)
            self._connecting.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            connecting, self._connecting = self._connecting, None
        self._conn = conn
        connecting.set_result(conn)
        return conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()


class RedisPyBatches:
    """``Batches`` over ``redis.asyncio`` (TLS and every other URL redis-py reads)."""

    def __init__(self, url: str) -> None:
        self.client = redis.asyncio.Redis.from_url(url)

    async def run(self, *commands: tuple[Any, ...]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return [ReplyError(str(r)) if isinstance(r, redis.ResponseError) else r for r in replies]

    async def close(self) -> None:
        await self.client.aclose()


def batches_for_url(url: str) -> Batches:
    """The pipelined client for plain ``redis://``/``unix://`` URLs without query
    options; redis-py for anything else."""
    parts = urlsplit(url)
    password = unquote(parts.password) if parts.password is not None else None
    username = unquote(parts.username) if parts.username else None
    if parts.query or parts.fragment:
        return RedisPyBatches(url)
    if parts.scheme == "redis":
        db = (parts.path or "/").lstrip("/") or "0"
        if not db.isdigit():
            return RedisPyBatches(url)
        return RedisBatches(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 6379,
            db=int(db),
            username=username,
            password=password,
        )
    if parts.scheme == "unix" and parts.path:
        return RedisBatches(path=unquote(parts.path), username=username, password=password)
    return RedisPyBatches(url)
