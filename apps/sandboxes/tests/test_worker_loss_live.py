"""Killing the Celery worker in the middle of provisioning leaves no orphan."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
import pytest
from django.conf import settings
from django.utils import timezone

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services.provisioning import sandbox_reap

pytestmark = pytest.mark.timeout(240)


def _until(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_it_leaves_no_orphan_when_the_worker_dies_mid_provision(live, make_tenant):
    _, secret = make_tenant()
    # The worker pauses after the backend made the sandbox's resources, before readiness.
    live.restart_worker({"HEDGEROW_FAULTS": "provision.after_backend=sleep:120"})
    try:
        http = httpx.Client(
            base_url=live.url + "/api/v1",
            headers={"Authorization": f"Bearer {secret}"},
            trust_env=False,
        )
        created = http.post("/sandboxes", json={"image": "host"})
        assert created.status_code == 201
        row = Sandbox.objects.get(external_id=created.json()["id"])
        backend = get_backend()
        _until(
            lambda: any(
                i.sandbox_id == row.id.hex and i.kind == "process" for i in backend.inventory()
            ),
            what="the sandbox process to exist",
        )
        row.refresh_from_db()
        assert row.state == State.PROVISIONING
        live.worker.kill()  # SIGKILL: no cleanup, no ack
    finally:
        live.restart_worker({})

    # The pending-timeout reaper finds it (we run it as if the deadline had passed).
    counts = sandbox_reap(
        now=timezone.now() + timedelta(seconds=settings.HEDGEROW_PENDING_TIMEOUT_S + 5)
    )
    assert counts["pending_timeout"] == 1
    row.refresh_from_db()
    assert row.state == State.FAILED
    _until(
        lambda: not [i for i in get_backend().inventory() if i.sandbox_id == row.id.hex],
        what="the orphaned resources to be destroyed",
    )
    reasons = list(
        SandboxEvent.objects.filter(sandbox=row, event="transition").values_list(
            "to_state", "reason"
        )
    )
    assert reasons == [("provisioning", "scheduled"), ("failed", "pending_timeout")]
