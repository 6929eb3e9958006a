"""The per-task health check of pool-less processes (controlplane/pgconn): a quiet
connection is taken as healthy without a query; one Postgres dropped is found and
replaced."""

from __future__ import annotations

import select
import time
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from controlplane.pgconn.base import DatabaseWrapper

pytestmark = pytest.mark.django_db(transaction=True)  # an idle connection, as in a task


def _conninfo() -> str:
    s = connection.settings_dict
    return psycopg.conninfo.make_conninfo(
        dbname=s["NAME"],
        user=s["USER"],
        password=s["PASSWORD"] or None,
        host=s["HOST"],
        port=str(s["PORT"]),
    )


def _last_query_of(pid: int) -> str:
    """What the backend serving ``pid`` last ran, as Postgres itself reports it."""
    with psycopg.connect(_conninfo(), autocommit=True) as admin:
        row = admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    assert row is not None
    return str(row[0])


def test_it_is_the_engine_of_processes_without_the_pool() -> None:
    assert isinstance(connections["default"], DatabaseWrapper)


def test_it_takes_a_quiet_connection_as_healthy_without_a_round_trip() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 'before the check'")
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    assert connection.is_usable()
    # The stock check would have sent SELECT 1 on this backend.
    assert _last_query_of(pid) == "SELECT pg_backend_pid()"


def test_it_finds_a_connection_postgres_dropped_and_reconnects() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    with psycopg.connect(_conninfo(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    raw: Any = connection.connection
    # Wait for the server's goodbye to reach the socket (what a restart sends too).
    deadline = time.monotonic() + 10
    while not select.select([raw.fileno()], [], [], 0.05)[0] and time.monotonic() < deadline:
        pass
    assert connection.is_usable() is False
    connections["default"].health_check_done = False  # type: ignore[attr-defined]
    connection.close_if_health_check_failed()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != pid
