"""Helpers for the fault-injection tests: HTTP against the live stack, waits, and the
closing check every scenario ends with (reconcile, then the audit balances, leaked 0)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import httpx
from django.utils import timezone

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox, SandboxEvent
from apps.sandboxes.services.audit import AuditReport, AuditSlice, audit_compute
from apps.sandboxes.services.reconcile import sandbox_reconcile

T = TypeVar("T")


def api(url: str, secret: str, timeout: float = 60) -> httpx.Client:
    return httpx.Client(
        base_url=url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=timeout,
        trust_env=False,
    )


def until(predicate: Callable[[], T], timeout: float = 60.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def create_ready(http: httpx.Client, **body: Any) -> dict[str, Any]:
    created = http.post("/sandboxes", json={"image": "host", **body})
    assert created.status_code == 201, created.text
    waited = http.get(f"/sandboxes/{created.json()['id']}/wait", params={"timeout": 60})
    assert waited.status_code == 200, waited.text
    result: dict[str, Any] = waited.json()
    return result


def row(external_id: str) -> Sandbox:
    return Sandbox.objects.get(external_id=external_id)


def wait_state(sandbox: Sandbox, state: str, timeout: float = 60) -> Sandbox:
    def reached() -> bool:
        sandbox.refresh_from_db()
        return sandbox.state == state

    until(reached, timeout, f"{sandbox.external_id} to become {state} (is {sandbox.state})")
    return sandbox


def transitions(sandbox: Sandbox) -> list[tuple[str, str]]:
    return list(
        SandboxEvent.objects.filter(sandbox=sandbox, event="transition").values_list(
            "to_state", "reason"
        )
    )


def resources_of(sandbox: Sandbox) -> list[str]:
    return [i.kind for i in get_backend().inventory() if i.sandbox_id == sandbox.id.hex]


def reconciled_audit(*, tenant: Any, since: datetime) -> AuditReport:
    """What every scenario ends with: a reconciler round, then the tenant's audit must
    balance with nothing leaked and nothing the ledger cannot explain."""
    run = sandbox_reconcile()
    assert not run.skipped, run.skip_reason
    report = audit_compute(
        period_start=since, period_end=timezone.now(), audit_slice=AuditSlice(tenant=tenant)
    )
    assert report.terms["leaked"] == 0, report.as_dict()
    assert report.balanced, report.as_dict()
    return report
