from __future__ import annotations

from typing import Any

from django.db.backends.postgresql import base

from controlplane.dbpool import check_if_idle


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self) -> Any:
        pool = super().pool  # type: ignore[misc]  # the stubs lack it (Django ≥ 5.1)
        # Django passes ``check`` itself (the stock check, or None without
        # CONN_HEALTH_CHECKS), so pool options cannot carry ours: it is set once, on the
        # pool Django made (psycopg_pool reads it on every checkout; a test pins that).
        if pool is not None and pool._check is not check_if_idle:
            pool._check = check_if_idle
        return pool
