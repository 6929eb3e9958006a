"""Django's PostgreSQL backend with a health check that costs no round trip when the
connection has nothing to say; the engine of every process without the web's pool
(the Celery worker above all).

With ``CONN_HEALTH_CHECKS`` Django checks a persistent connection before the first
query of each request or Celery task with ``SELECT 1``: a round trip and a statement
for Postgres per task, two per sandbox lifecycle. A Postgres that restarted or dropped
the connection has already written to it (its ``FATAL`` message) and closed it, so the
socket is readable; an idle connection in good health has nothing to read. Only a
readable socket (or a connection not idle) gets the stock ``SELECT 1``, which then
fails and Django reconnects, as before. A server that vanishes without closing the
socket (a host gone) is found by the first real query either way.
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg import pq


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        conn = self.connection
        if conn is None or conn.closed:
            return False
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            return bool(super().is_usable())
        try:
            readable, _, _ = select.select([conn.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        if readable:
            return bool(super().is_usable())
        return True
