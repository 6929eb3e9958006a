"""Health checks for the web process's psycopg pool, only where they can find something.

With ``CONN_HEALTH_CHECKS`` Django gives the pool ``ConnectionPool.check_connection``,
which sends an empty query on *every* checkout: one more Postgres round trip per
request (a third of a one-row read's statements), for connections that were in use a
few milliseconds earlier. Here a connection is checked only when its previous checkout
was at least ``RECHECK_AFTER_S`` ago — long enough that Postgres could have restarted
or dropped it meanwhile (a connection never checked out yet is checked too). A
connection that dies within that window still fails its request cleanly: the error is
a typed 503 with ``Retry-After`` (``apps.core.errors``), and the pool discards the
broken connection when it comes back.

(The time is taken at checkout, not when the connection comes back: a ``reset``
callback would make the pool hand every returned connection to a worker thread.)
"""

from __future__ import annotations

import time
from typing import Any

from psycopg_pool import ConnectionPool

RECHECK_AFTER_S = 1.0
_CHECKED_OUT_AT = "_hedgerow_checked_out_at"


def check_if_idle(conn: Any) -> None:
    """The pool's ``check`` callback, run on every checkout."""
    now = time.monotonic()
    last = getattr(conn, _CHECKED_OUT_AT, None)
    if last is None or now - last >= RECHECK_AFTER_S:
        ConnectionPool.check_connection(conn)  # raises: the pool replaces the connection
    setattr(conn, _CHECKED_OUT_AT, now)
