"""Env values are secrets at rest (docs/security.md "Secrets"): a value planted in a
command's env through every path that records one — the REST exec's Django path, its
event-loop fast path (the SDK), a streamed exec, E2B ``envVars`` and envd's process
Start — runs with its value, and is then absent from the database's plaintext, from
every API answer, from the stack's logs and from the episode export; the sealed form
decrypts back to it (what a resumed stream pump re-sends)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

import pytest
from django.db import connection
from e2b import Sandbox as E2BSandbox
from hedgerow import Client
from rest_framework.test import APIClient

from apps.e2b.models import SandboxEnv
from apps.e2b.tests.live import opts
from apps.sandboxes.exec_env import ENV_REDACTED, ENV_SEALED
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services.operations import request_from_record
from apps.sandboxes.tests.live_api import api_client, ready_sandbox, wait_all_deleted
from apps.trajectories.models import Step

pytestmark = pytest.mark.timeout(240)

# the command prints the value's hash, never the value (output is stored as it is)
PRINT_HASH = 'printf %s "$SECRET" | sha256sum | cut -c1-64'


def _secret() -> str:
    return f"s3cr3t-{uuid.uuid4().hex}"


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _db_text() -> str:
    """Every row of every table that records commands, episodes and E2B env, as text."""
    tables = [
        "sandboxes_operation",
        "sandboxes_sandboxevent",
        "e2b_sandboxenv",
        "trajectories_step",
        "trajectories_episode",
    ]
    parts = []
    with connection.cursor() as cur:
        for table in tables:
            cur.execute(f"SELECT coalesce(string_agg(t::text, '\n'), '') FROM {table} t")
            parts.append(cur.fetchone()[0])
    return "\n".join(parts)


def _wait_finished(op_id: str, timeout: float = 60.0) -> Operation:
    deadline = time.monotonic() + timeout
    while True:
        op = Operation.objects.get(operation_id=op_id)
        if op.status != OperationStatus.RUNNING:
            return op
        assert time.monotonic() < deadline, f"{op_id} still running"
        time.sleep(0.1)


def test_env_values_never_rest_in_plaintext_nor_show_anywhere(live, make_tenant):
    tenant, key = make_tenant()
    secrets = {name: _secret() for name in ("drf", "fast", "stream", "e2b_sandbox", "e2b_cmd")}
    http = api_client(live, key)
    sandbox_id = ready_sandbox(http)
    answers: list[Any] = []

    # 1. the REST exec's Django path (in process: DRF's ExecView, operations.py)
    drf = APIClient()
    drf.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    body = {"command": PRINT_HASH, "env": {"SECRET": secrets["drf"]}, "operation_id": "op-drf"}
    done = drf.post(f"/api/v1/sandboxes/{sandbox_id}/exec", body, format="json")
    assert done.status_code == 200, done.content
    assert done.json()["stdout"].strip() == _sha(secrets["drf"])
    answers.append(done.content.decode())
    # a replay with the same env is the same operation; another value is a conflict
    assert drf.post(f"/api/v1/sandboxes/{sandbox_id}/exec", body, format="json").status_code == 200
    other = {**body, "env": {"SECRET": "different"}}
    conflict = drf.post(f"/api/v1/sandboxes/{sandbox_id}/exec", other, format="json")
    assert conflict.status_code == 409, conflict.content

    # 2. the fast path (a plain REST exec on the event loop) and an episode, via the SDK
    with Client(url=live.url, api_key=key, max_retries=1, timeout=90) as hr:
        sb = hr.get(sandbox_id)
        with sb.episode(task_id="env-secret", harness="t", model="m") as episode:
            result = sb.exec(PRINT_HASH, env={"SECRET": secrets["fast"]}, operation_id="op-fast")
            assert result.stdout.strip() == _sha(secrets["fast"])
        episode_id = episode.id

    # 3. a streamed exec (the pump relays it; the final result lands on the row)
    started = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={
            "command": PRINT_HASH,
            "env": {"SECRET": secrets["stream"]},
            "stream": True,
            "operation_id": "op-stream",
        },
    )
    assert started.status_code in (200, 202), started.text
    answers.append(started.text)
    streamed = _wait_finished("op-stream")
    assert streamed.termination == "exited"
    assert _sha(secrets["stream"]) in json.dumps(streamed.stdout)  # {"text": …, totals}

    # 4. E2B: envVars at create and a command's own envs through envd's process Start
    sbx = E2BSandbox.create(envs={"SECRET": secrets["e2b_sandbox"]}, **opts(live, key))
    ran = sbx.commands.run(PRINT_HASH)
    assert ran.stdout.strip() == _sha(secrets["e2b_sandbox"])
    ran = sbx.commands.run(PRINT_HASH, envs={"SECRET": secrets["e2b_cmd"]})
    assert ran.stdout.strip() == _sha(secrets["e2b_cmd"])
    e2b_ops = list(Operation.objects.filter(sandbox__external_id=sbx.sandbox_id))
    assert len(e2b_ops) == 2

    # --- the database holds names and sealed values only
    text = _db_text()
    for name, value in secrets.items():
        assert value not in text, f"{name}'s value is in the database in plaintext"
    for op_id, name in (("op-drf", "drf"), ("op-fast", "fast"), ("op-stream", "stream")):
        op = Operation.objects.get(operation_id=op_id)
        assert op.request["env"] == {"SECRET": ENV_REDACTED}
        assert ENV_SEALED in op.request
        # what a resumed pump re-sends to the agent: the real value
        assert request_from_record(op.request).env == {"SECRET": secrets[name]}
    row = SandboxEnv.objects.get(sandbox__external_id=sbx.sandbox_id)
    assert row.env == {"SECRET": ENV_REDACTED} and row.env_sealed
    assert {o.request["env"]["SECRET"] for o in e2b_ops} == {ENV_REDACTED}
    assert sorted(request_from_record(o.request).env["SECRET"] for o in e2b_ops) == sorted(
        [secrets["e2b_sandbox"], secrets["e2b_cmd"]]
    )

    # --- no API answer shows a value: operations, sandbox, episode, its export
    for path in (
        f"/sandboxes/{sandbox_id}/operations/op-drf",
        f"/sandboxes/{sandbox_id}/operations/op-fast",
        f"/sandboxes/{sandbox_id}/operations/op-stream",
        f"/sandboxes/{sandbox_id}/operations",
        f"/sandboxes/{sandbox_id}",
        f"/episodes/{episode_id}",
        "/episodes/export",
    ):
        got = http.get(path)
        assert got.status_code == 200, (path, got.text)
        answers.append(got.text)
    exported = [json.loads(line) for line in answers[-1].splitlines() if line.strip()]
    assert [r["episode_id"] for r in exported] == [episode_id]
    # the episode's exec step keeps the env names, not the values (the marker may be
    # replaced by the trajectories' own redaction placeholder)
    step = Step.objects.get(episode__episode_id=episode_id, operation_id="op-fast")
    recorded: dict[str, Any] = step.request or {}
    assert set(recorded["env"]) == {"SECRET"}
    assert recorded["env"]["SECRET"] not in secrets.values()
    assert ENV_SEALED not in recorded
    for answer in answers:
        for name, value in secrets.items():
            assert value not in answer, f"{name}'s value is in an API answer"

    sbx.kill()
    assert http.delete(f"/sandboxes/{sandbox_id}").status_code in (200, 202, 204)
    wait_all_deleted(tenant)

    # --- nor in the stack's logs (web, worker) or this process's
    logs = "\n".join(p.read_text(errors="replace") for p in live.log_dir.glob("*.log"))
    assert logs, "the stack's logs were not found"
    for name, value in secrets.items():
        assert value not in logs, f"{name}'s value is in the stack's logs"
