"""The exec hot path's Postgres statements: libpq (psycopg's ``pq`` layer) driven by
the event loop, over a few pooled autocommit connections per process.

Why not psycopg's AsyncConnection with psycopg_pool: per statement, their Python — the
pool's checkout and return, a cursor and its Transformer, parameter dumping, the
prepared-statement bookkeeping, adding and removing the socket's reader on every wait
— cost ~150–180 µs of the web worker's CPU here, twice per exec. The same statement
sent prepared, with text parameters, costs ~25–60 µs.

psycopg still makes the connections (conninfo as Django's, auth, TLS). Each statement
is prepared once per connection, or sent unnamed when Django's database OPTIONS set
``prepare_threshold: None`` (PgBouncer in transaction mode). Statements carry their
own casts (``$1::uuid``); parameters go as text. Errors are ``psycopg.Error``:
``OperationalError`` when the connection failed, ``DatabaseError`` for the statement.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq

__all__ = ["PgPool", "Statement"]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


@dataclass(frozen=True)
class Statement:
    name: bytes
    sql: bytes


def text(value: Any) -> bytes | None:
    """A parameter in Postgres' text input format."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int | float | uuid.UUID):
        return str(value).encode()
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("naive datetime")  # timestamptz: the zone must be explicit
        return value.isoformat().encode()
    raise TypeError(f"no text format for {type(value).__name__}")


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Conn:
    def __init__(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self.connection = connection  # kept: it owns the libpq handle
        self.pg = connection.pgconn
        self.pg.nonblocking = 1
        self.fd = self.pg.socket
        self.loop = asyncio.get_running_loop()
        self.prepared: set[bytes] = set()
        self.waiter: asyncio.Future[None] | None = None
        self.broken = False
        # Registered once for the connection's life, not per wait (two epoll_ctl each).
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        if self.waiter is not None:
            if not self.waiter.done():
                self.waiter.set_result(None)
            return
        # Idle and readable: a notice, or the server closed the connection. Read it, so
        # the level-triggered reader does not fire again for the same bytes.
        try:
            self.pg.consume_input()
        except psycopg.OperationalError:
            self.close()
        else:
            if self.pg.status != pq.ConnStatus.OK:
                self.close()

    async def _readable_again(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def _flush(self) -> None:
        while self.pg.flush():  # 1: part of the message is still to be sent
            writable: asyncio.Future[None] = self.loop.create_future()
            self.loop.add_writer(self.fd, _set_done, writable)
            try:
                await writable
            finally:
                self.loop.remove_writer(self.fd)

    async def _result(self) -> pq.abc.PGresult:
        last: pq.abc.PGresult | None = None
        error: pq.abc.PGresult | None = None
        while True:
            self.pg.consume_input()
            while not self.pg.is_busy():
                result = self.pg.get_result()
                if result is None:
                    if error is not None:
                        raise psycopg.DatabaseError(pq.error_message(error))
                    if last is None:
                        raise psycopg.OperationalError("Postgres sent no result")
                    return last
                if result.status in _OK:
                    last = result
                else:
                    error = result
            await self._readable_again()

    async def execute(
        self, statement: Statement, params: list[bytes | None], prepare: bool
    ) -> pq.abc.PGresult:
        if not prepare:
            self.pg.send_query_params(statement.sql, params)
        else:
            if statement.name not in self.prepared:
                self.pg.send_prepare(statement.name, statement.sql)
                await self._flush()
                await self._result()
                self.prepared.add(statement.name)
            self.pg.send_query_prepared(statement.name, params)
        await self._flush()
        return await self._result()

    def reusable(self) -> bool:
        return (
            not self.broken
            and self.pg.status == pq.ConnStatus.OK
            and self.pg.transaction_status == pq.TransactionStatus.IDLE
        )

    def close(self) -> None:
        if not self.broken:
            self.broken = True
            self.loop.remove_reader(self.fd)
            self.pg.finish()


class PgPool:
    """Connections held per statement, never across an await on anything else, so a
    few serve hundreds of concurrent execs. Made on demand up to ``max_size``; a caller
    that finds none free waits up to ``timeout`` seconds."""

    def __init__(
        self, conninfo: str, *, max_size: int, prepare: bool = True, timeout: float = 10.0
    ) -> None:
        self.conninfo, self.max_size, self.prepare, self.timeout = (
            conninfo,
            max_size,
            prepare,
            timeout,
        )
        self.idle: list[_Conn] = []
        self.size = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def execute(self, statement: Statement, params: list[Any]) -> pq.abc.PGresult:
        """Runs one statement in its own transaction (autocommit); its last result."""
        values = [p.encode() if type(p) is str else text(p) for p in params]  # mostly str
        conn = await self._get()
        try:
            return await conn.execute(statement, values, self.prepare)
        finally:
            # Cancelled or failed mid-statement, the connection's state is unknown.
            self._put(conn)

    async def _get(self) -> _Conn:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            while self.idle:
                conn = self.idle.pop()  # the most recent: its socket is warm
                if conn.reusable():
                    return conn
                conn.close()
                self.size -= 1
            if self.size < self.max_size:
                self.size += 1
                try:
                    connection = await psycopg.AsyncConnection.connect(
                        self.conninfo, autocommit=True
                    )
                except BaseException:
                    self.size -= 1
                    self._wake()
                    raise
                return _Conn(connection)
            woken: asyncio.Future[None] = loop.create_future()
            self.waiting.append(woken)
            try:
                async with asyncio.timeout_at(deadline):
                    await woken
            except TimeoutError:
                raise psycopg.OperationalError(
                    f"no Postgres connection free in {self.timeout:g} s"
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(woken)

    def _put(self, conn: _Conn) -> None:
        if conn.reusable():
            self.idle.append(conn)
        else:
            conn.close()
            self.size -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiting:
            woken = self.waiting.popleft()
            if not woken.done():
                woken.set_result(None)
                return

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
            self.size -= 1
