"""4. Redis restarted during a burst of creates and execs.

Redis is shared by everyone on this machine, so the scenario runs a private
``redis-server`` (no persistence: a restart loses every queued task, the worst case)
and a second web + worker on it, against the same test database and backend.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.db import connection
from django.utils import timezone

from apps.sandboxes.models import Operation, Sandbox, SandboxEvent, State
from apps.sandboxes.tests.faults import api, reconciled_audit, resources_of, until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

SANDBOXES = 6
RETRIES: list[str] = []  # what the outage did to the client, for failure messages
EXECS = 3


class PrivateRedis:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        until(self._pong, timeout=20, what="private redis to answer")

    def _pong(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def restart_after(self, delay: float) -> threading.Thread:
        """Kills Redis now and starts it again (empty) after ``delay`` seconds."""
        self.kill()

        def later() -> None:
            time.sleep(delay)
            self.start()

        thread = threading.Thread(target=later)
        thread.start()
        return thread


@pytest.fixture
def private_stack(live: Any, tmp_path: Path) -> Iterator[tuple[Any, PrivateRedis]]:
    from conftest import Stack, _free_port

    server = PrivateRedis(_free_port())
    server.start()
    stack = Stack(connection.settings_dict["NAME"], tmp_path)
    stack.env["HEDGEROW_REDIS_URL"] = server.url
    stack.env["HEDGEROW_CELERY_BROKER_URL"] = server.url
    stack.start()
    try:
        yield stack, server
    finally:
        stack.stop()
        server.kill()


def _retrying(call: Any, what: str) -> httpx.Response:
    """What a careful client does: retry transport errors and 5xx with the same
    idempotency key / operation id, so a retry can never create or run twice."""
    last: Any = None
    for _ in range(60):
        try:
            response = call()
            if response.status_code < 500:
                return response  # type: ignore[no-any-return]
            last = response.text
        except httpx.HTTPError as exc:
            last = exc
        RETRIES.append(f"{what}: {last}")
        time.sleep(0.25)
    raise AssertionError(f"{what} kept failing: {last}")


def test_it_loses_and_duplicates_nothing_when_redis_restarts_mid_burst(
    private_stack: tuple[Any, PrivateRedis], make_tenant: Any, settings: Any
) -> None:
    stack, server = private_stack
    tenant, secret = make_tenant()
    since = timezone.now()
    http = api(stack.url, secret, timeout=30)
    keys = [f"burst-{uuid.uuid4().hex[:8]}-{i}" for i in range(SANDBOXES)]

    restarts = []
    ids: list[str] = []
    for i, key in enumerate(keys):
        if i == SANDBOXES // 2:
            restarts.append(server.restart_after(0.5))
        created = _retrying(
            lambda key=key: http.post(
                "/sandboxes", json={"image": "host"}, headers={"Idempotency-Key": key}
            ),
            "create",
        )
        assert created.status_code in (200, 201), created.text
        ids.append(created.json()["id"])
    for thread in restarts:
        thread.join()

    # Tasks queued in Redis when it died are gone: the reconciler enqueues them again.
    settings.HEDGEROW_REQUEUE_AFTER_S = 0

    def all_ready() -> bool:
        if Sandbox.objects.filter(tenant=tenant, state=State.REQUESTED).exists():
            from apps.sandboxes.services.reconcile import sandbox_reconcile

            sandbox_reconcile()
        states = set(Sandbox.objects.filter(tenant=tenant).values_list("state", flat=True))
        return states == {State.READY}

    until(all_ready, timeout=120, what="every sandbox to become ready")
    assert len(set(ids)) == SANDBOXES
    assert Sandbox.objects.filter(tenant=tenant).count() == SANDBOXES, RETRIES
    # Whatever the outage swallowed, the ledger says it was picked up again.
    stalled = SandboxEvent.objects.filter(tenant=tenant, event="provision_requeued")
    assert all(e.reason == "stalled_request" for e in stalled)

    restarts = []
    for n in range(EXECS):
        for i, sandbox_id in enumerate(ids):
            if n == 1 and i == SANDBOXES // 2:
                restarts.append(server.restart_after(0.5))
            body = {"command": "echo x >> /workspace/ran", "operation_id": f"op-{n}"}
            ran = _retrying(
                lambda sandbox_id=sandbox_id, body=body: http.post(
                    f"/sandboxes/{sandbox_id}/exec", json=body
                ),
                "exec",
            )
            assert ran.status_code == 200, ran.text
    for thread in restarts:
        thread.join()
    for sandbox_id in ids:
        count = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "wc -l < ran"})
        assert count.json()["stdout"].strip() == str(EXECS), sandbox_id
    assert Operation.objects.filter(tenant=tenant).count() == SANDBOXES * (EXECS + 1)

    for sandbox_id in ids:
        assert (
            _retrying(lambda s=sandbox_id: http.delete(f"/sandboxes/{s}"), "delete").status_code
            == 202
        )
    until(
        lambda: set(Sandbox.objects.filter(tenant=tenant).values_list("state", flat=True))
        == {State.DELETED},
        timeout=60,
        what="every sandbox to be deleted",
    )
    assert all(resources_of(s) == [] for s in Sandbox.objects.filter(tenant=tenant))
    report = reconciled_audit(tenant=tenant, since=since)
    assert (report.created, report.terms["deleted"]) == (SANDBOXES, SANDBOXES)
