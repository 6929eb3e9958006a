"""The exec hot path's libpq pool (apps/core/pg_async.py) against the test
database: statements, their errors, and connections that break, hang or run out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
import uvloop
from django.db import connections

from apps.core.pg_async import PgPool, Statement, text

ECHO = Statement(b"t_echo", b"SELECT $1::uuid, $2::text, $3::int, $4::timestamptz, $5::bigint")
SLEEP = Statement(b"t_sleep", b"SELECT pg_sleep($1::float8)")
BAD = Statement(b"t_bad", b"SELECT 1 / $1::int")
PID = Statement(b"t_pid", b"SELECT pg_backend_pid()")


def _conninfo() -> str:
    db = connections["default"].settings_dict
    return psycopg.conninfo.make_conninfo(
        dbname=db["NAME"],
        user=db["USER"],
        password=db["PASSWORD"] or None,
        host=db["HOST"],
        port=str(db["PORT"]),
    )


def _run(loop_kind: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(fn())
    finally:
        loop.close()


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Waits on the event loop until ``condition`` holds; fails after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_it_sends_parameters_in_postgres_text_format():
    when = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert text(when) == b"2026-01-02T03:04:05.000006+00:00"
    assert (text(None), text(True), text(7), text("é")) == (None, b"true", b"7", "é".encode())
    with pytest.raises(ValueError):
        text(datetime(2026, 1, 2))  # naive: which zone?
    with pytest.raises(TypeError):
        text(object())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("prepare", [True, False])
def test_it_runs_statements_and_reuses_its_connection(db, loop_kind, prepare):
    pk, when = uuid.uuid4(), datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)

    async def scenario() -> None:
        pool = PgPool(_conninfo(), max_size=2, prepare=prepare)
        try:
            for _ in range(3):
                result = await pool.execute(ECHO, [pk, "sb-1", 42, when, None])
                row = [result.get_value(0, i) for i in range(result.nfields)]
                assert row[:3] == [str(pk).encode(), b"sb-1", b"42"] and row[4] is None
                assert row[3] is not None and row[3].startswith(b"2026-01-02 03:04:05.000006")
            with pytest.raises(psycopg.DatabaseError) as info:
                await pool.execute(BAD, [0])
            assert "division by zero" in str(info.value)
            assert not isinstance(info.value, psycopg.OperationalError)
            assert (await pool.execute(BAD, [1])).get_value(0, 0) == b"1"
            assert pool.size == 1 and len(pool.idle) == 1  # one connection did it all
        finally:
            await pool.close()

    _run(loop_kind, scenario)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_it_replaces_a_connection_the_server_closed(db, loop_kind):
    async def scenario() -> None:
        pool = PgPool(_conninfo(), max_size=2)
        try:
            pid = (await pool.execute(PID, [])).get_value(0, 0)
            assert pid is not None
            with psycopg.connect(_conninfo(), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [int(pid)])
            # the idle connection's reader sees the close (a state, waited on)
            await _until(lambda: pool.idle == [] or not pool.idle[0].reusable())
            assert (await pool.execute(PID, [])).get_value(0, 0) != pid
            assert pool.size == 1
        finally:
            await pool.close()

    _run(loop_kind, scenario)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_it_drops_a_connection_left_mid_statement_and_waits_for_a_free_one(db, loop_kind):
    async def scenario() -> None:
        pool = PgPool(_conninfo(), max_size=1, timeout=0.3)
        try:
            slow = asyncio.ensure_future(pool.execute(SLEEP, [5]))
            await _until(lambda: pool.size == 1 and pool.idle == [])  # checked out
            # The one connection is busy: a second caller waits, then gives up.
            with pytest.raises(psycopg.OperationalError, match="no Postgres connection free"):
                await pool.execute(PID, [])
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert pool.size == 0 and pool.idle == []  # its state was unknown: closed
            waiter = asyncio.ensure_future(pool.execute(SLEEP, [0.05]))
            assert (await pool.execute(PID, [])).get_value(0, 0) is not None
            await waiter
            assert pool.size == 1
        finally:
            await pool.close()

    _run(loop_kind, scenario)
