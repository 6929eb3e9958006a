"""Migration e2b 0002 seals env values already at rest (E2B envVars and recorded
commands' env) and its reverse restores them: rows written before it, by its own
historical models, come out as names + one Fernet token, and back."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from apps.core import crypto

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("e2b", "0001_sandbox_env")]
AFTER = [("e2b", "0002_sandbox_env_sealed")]


def _migrate(target: list[tuple[str, str]]) -> Any:
    """Migrates e2b to target; returns the historical apps of the whole project there
    (every other app at its latest migration, as the database is)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target)
    executor.loader.build_graph()
    nodes = [n for n in executor.loader.graph.leaf_nodes() if n[0] != "e2b"] + target
    return executor.loader.project_state(nodes).apps


def test_existing_env_values_are_sealed_and_the_reverse_restores_them(make_tenant):
    tenant, _ = make_tenant()
    secret = f"plain-{uuid.uuid4().hex}"
    try:
        apps = _migrate(BEFORE)
        Sandbox = apps.get_model("sandboxes", "Sandbox")
        Operation = apps.get_model("sandboxes", "Operation")
        SandboxEnv = apps.get_model("e2b", "SandboxEnv")
        sandbox = Sandbox.objects.create(
            tenant_id=tenant.pk,
            external_id="sb-mig",
            state="ready",
            image="host",
            cpu_millis=1000,
            memory_mib=512,
            ttl_seconds=600,
            expires_at=timezone.now() + timedelta(minutes=10),
            backend="local",
        )
        SandboxEnv.objects.create(sandbox=sandbox, env={"TOKEN": secret})
        with_env = Operation.objects.create(
            tenant_id=tenant.pk,
            sandbox=sandbox,
            operation_id="op-env",
            generation=1,
            request={"command": "true", "env": {"TOKEN": secret}},
            request_hash="h1",
        )
        without = Operation.objects.create(
            tenant_id=tenant.pk,
            sandbox=sandbox,
            operation_id="op-none",
            generation=1,
            request={"command": "true", "env": {}},
            request_hash="h2",
        )

        apps = _migrate(AFTER)
        Operation = apps.get_model("sandboxes", "Operation")
        SandboxEnv = apps.get_model("e2b", "SandboxEnv")
        sealed = Operation.objects.get(pk=with_env.pk).request
        assert sealed["env"] == {"TOKEN": "[redacted]"}
        assert json.loads(crypto.decrypt(sealed["env_sealed"])) == {"TOKEN": secret}
        assert Operation.objects.get(pk=without.pk).request == {"command": "true", "env": {}}
        row = SandboxEnv.objects.get(sandbox_id=sandbox.pk)
        assert row.env == {"TOKEN": "[redacted]"}
        assert json.loads(crypto.decrypt(row.env_sealed)) == {"TOKEN": secret}
        with connection.cursor() as cur:
            cur.execute("SELECT request::text FROM sandboxes_operation")
            assert all(secret not in r[0] for r in cur.fetchall())
            cur.execute("SELECT env::text, env_sealed FROM e2b_sandboxenv")
            assert all(secret not in r[0] + r[1] for r in cur.fetchall())

        apps = _migrate(BEFORE)
        Operation = apps.get_model("sandboxes", "Operation")
        SandboxEnv = apps.get_model("e2b", "SandboxEnv")
        assert Operation.objects.get(pk=with_env.pk).request == {
            "command": "true",
            "env": {"TOKEN": secret},
        }
        assert SandboxEnv.objects.get(sandbox_id=sandbox.pk).env == {"TOKEN": secret}
    finally:
        _migrate(AFTER)  # the schema the rest of the suite expects
