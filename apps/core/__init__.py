"""The ground floor: what every app needs and that knows no app — the error envelope,
JSON logs with redaction, input parsing, JSON-safe values, the async DB helpers, the
hot path's own Postgres and Redis drivers and secrets at rest (``crypto.py``). Imports
only the standard library, Django, DRF and the drivers' libraries (the import contract
says so); ``controlplane`` is the project's wiring (settings, urls, ASGI, Celery), not a
floor to build on."""
