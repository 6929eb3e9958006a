"""Django's PostgreSQL backend with the web pool's idle-only health check
(controlplane/dbpool.py); used only when ``HEDGEROW_DB_POOL`` is on."""
