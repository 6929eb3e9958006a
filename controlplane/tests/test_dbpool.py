"""The web pool's health check (controlplane/dbpool.py): skipped for a connection handed
back a moment ago, done for one that sat idle, which the pool then replaces."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import connection
from psycopg_pool import ConnectionPool

from controlplane import dbpool
from controlplane.pgpool.base import DatabaseWrapper


def _conninfo() -> str:
    s = connection.settings_dict
    return psycopg.conninfo.make_conninfo(
        dbname=s["NAME"],
        user=s["USER"],
        password=s["PASSWORD"] or None,
        host=s["HOST"],
        port=str(s["PORT"]),
    )


def _terminate(pid: int) -> None:
    with psycopg.connect(_conninfo(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


def _age(conn: Any) -> None:
    """As if its last checkout were longer ago than the recheck interval."""
    at = getattr(conn, dbpool._CHECKED_OUT_AT)
    setattr(conn, dbpool._CHECKED_OUT_AT, at - 2 * dbpool.RECHECK_AFTER_S)


@pytest.fixture
def pool(db: Any) -> Any:
    pool = ConnectionPool(
        _conninfo(),
        min_size=1,
        max_size=1,
        check=dbpool.check_if_idle,
        kwargs={"autocommit": True},
        open=True,
    )
    yield pool
    pool.close()


def test_it_checks_a_connection_that_sat_idle_and_replaces_it_if_dead(pool):
    conn = pool.getconn()
    first_pid = conn.info.backend_pid
    pool.putconn(conn)
    _terminate(first_pid)
    # As if it had sat in the pool for longer than the recheck interval.
    _age(conn)
    with pool.connection() as fresh:
        assert fresh.execute("SELECT 1").fetchone() == (1,)
        assert fresh.info.backend_pid != first_pid


def test_it_skips_the_check_for_a_connection_just_handed_back(pool, monkeypatch):
    with pool.connection() as conn:
        conn.execute("SELECT 1")
    checked: list[Any] = []
    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(checked.append))
    with pool.connection() as again:
        assert again is conn
    assert checked == []  # no round trip
    _age(conn)
    with pool.connection():
        pass
    assert checked == [conn]


def test_it_installs_the_check_on_the_pool_django_builds(db):
    settings_dict = {
        **connection.settings_dict,
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "OPTIONS": {"pool": {"min_size": 1, "max_size": 1}},
    }
    wrapper = DatabaseWrapper(settings_dict, alias="pool-check-test")
    try:
        assert wrapper.pool._check is dbpool.check_if_idle
    finally:
        wrapper.close_pool()  # type: ignore[attr-defined]
