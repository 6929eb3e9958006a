"""A private Hedgerow stack for one benchmark run: its own instance, database, key,
web and worker processes; everything it made is removed at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def private_stack(
    name: str, env: dict[str, str], configure: Callable[[Any], None]
) -> Iterator[tuple[Any, str]]:
    """Yields (started conftest.Stack, API key secret). ``name`` prefixes the instance
    and database; ``env`` is added to this process's environment before Django starts
    (the stack's processes inherit it); ``configure`` adjusts the web/worker processes
    before they start."""
    pid = os.getpid()
    db_name = f"hr_bench_{name}_{pid}"
    os.environ.update(
        HEDGEROW_INSTANCE=f"{name}{pid}",
        HEDGEROW_DB_NAME=db_name,
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        HEDGEROW_LOG_LEVEL="WARNING",
        **env,
    )
    # A throwaway key for this private stack (settings refuse a known default); the
    # stack's processes inherit it, so agent tokens agree.
    os.environ.setdefault("HEDGEROW_SECRET_KEY", uuid.uuid4().hex + uuid.uuid4().hex)
    sys.path.insert(0, str(ROOT))
    import psycopg

    from apps.core.env import db_conninfo

    admin = psycopg.connect(db_conninfo("postgres"))
    admin.autocommit = True
    admin.execute(f'CREATE DATABASE "{db_name}"')
    stack = None
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True)
        import django

        django.setup()
        from apps.tenancy.services import api_key_create, tenant_create
        from conftest import Stack

        tenant = tenant_create(slug="bench")
        secret = api_key_create(tenant=tenant, name="bench", scopes=["read", "write"]).secret
        stack = Stack(db_name, Path(tempfile.mkdtemp(prefix=f"hr-{name}-")))
        configure(stack)
        stack.start()
        yield stack, secret
    finally:
        if stack is not None:
            stack.stop()
            _cleanup()
        from django.db import connections

        connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def _cleanup() -> None:
    from apps.sandboxes.backends import get_backend

    backend = get_backend()
    for sandbox_id in {i.sandbox_id for i in backend.inventory() if i.sandbox_id}:
        try:
            backend.destroy(sandbox_id)
        except Exception as exc:  # report, keep cleaning
            print(f"cleanup of {sandbox_id} failed: {exc}")
    # The private instance's bridge, nft table, cgroup group and subnet claim go too.
    teardown = getattr(backend, "teardown_instance", None)
    if teardown is not None:
        teardown()
