"""Observability against the real stack: one request id across web, worker and agent
logs, and /metrics reporting real values after real operations."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.sandboxes.backends import get_backend
from apps.sandboxes.tests.faults import api, row, until, wait_state

pytestmark = pytest.mark.timeout(180)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


def _with_request_id(path: Path, request_id: str) -> list[dict[str, Any]]:
    return [line for line in _json_lines(path) if line.get("request_id") == request_id]


def test_it_traces_one_request_id_through_web_worker_and_agent(live: Any, make_tenant: Any) -> None:
    _, secret = make_tenant()
    http = api(live.url, secret)
    create_id = f"trace-create-{uuid.uuid4().hex[:12]}"
    exec_id = f"trace-exec-{uuid.uuid4().hex[:12]}"

    created = http.post("/sandboxes", json={"image": "host"}, headers={"X-Request-Id": create_id})
    assert created.headers["X-Request-Id"] == create_id
    sandbox_id = created.json()["id"]
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).status_code == 200
    ran = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": "echo traced"},
        headers={"X-Request-Id": exec_id},
    )
    assert ran.status_code == 200 and ran.headers["X-Request-Id"] == exec_id
    agent_log = get_backend().sandboxes_dir / row(sandbox_id).id.hex / "agent.log"  # type: ignore[attr-defined]

    # The web process logs both requests (its access line) under their ids.
    web = until(lambda: _with_request_id(live.web.log_path, exec_id), what="web log line")
    assert any(line.get("path", "").endswith("/exec") for line in web)
    assert _with_request_id(live.web.log_path, create_id)
    # The worker that provisioned the sandbox logged its transitions under the create's id.
    worker = until(
        lambda: _with_request_id(live.worker.log_path, create_id), what="worker log line"
    )
    assert any("provisioning -> ready" in line["msg"] for line in worker)
    # The agent logged the worker's readiness probe and the exec under their ids.
    agent = _json_lines(agent_log)
    assert any(line.get("request_id") == exec_id and line.get("event") == "exec" for line in agent)
    assert any(line.get("request_id") == create_id for line in agent)


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else r"(?:\{\})?")
    match = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name}{{{labels}}} not in metrics"
    return float(match.group(1))


def test_it_exposes_real_metrics_after_real_operations(
    live: Any, make_tenant: Any, settings: Any
) -> None:
    from apps.sandboxes.services.audit import audit_run
    from apps.sandboxes.services.reconcile import sandbox_reconcile

    tenant, secret = make_tenant()
    http = api(live.url, secret)
    created = http.post("/sandboxes", json={"image": "host"}).json()
    assert http.get(f"/sandboxes/{created['id']}/wait", params={"timeout": 60}).status_code == 200
    for _ in range(3):
        assert http.post(f"/sandboxes/{created['id']}/exec", json={"command": "true"}).is_success
    sandbox_reconcile()
    audit_run()
    scrape = httpx.Client(base_url=live.url, trust_env=False, timeout=30)

    assert scrape.get("/metrics").status_code == 401
    assert scrape.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    # The token comes from the web process's environment (HEDGEROW_METRICS_TOKEN).
    response = scrape.get("/metrics", headers={"Authorization": f"Bearer {live.metrics_token}"})

    assert response.status_code == 200
    text = response.text
    assert _metric(text, "hedgerow_sandboxes", f'state="ready",tenant="{tenant.slug}"') == 1
    assert _metric(text, "hedgerow_sandbox_create_to_ready_seconds_count") == 1
    assert _metric(text, "hedgerow_sandbox_create_to_ready_seconds_sum") > 0
    assert _metric(text, "hedgerow_exec_duration_seconds_count") == 3
    assert _metric(text, "hedgerow_audit_term", 'term="created"') == 1
    assert _metric(text, "hedgerow_audit_term", 'term="live"') == 1
    assert _metric(text, "hedgerow_audit_term", 'term="leaked"') == 0
    assert _metric(text, "hedgerow_audit_balanced") == 1
    assert _metric(text, "hedgerow_reconcile_rounds_total", 'outcome="completed"') == 1
    assert "hedgerow_celery_queue_length{queue=" in text
    assert _metric(text, "hedgerow_admission_queue_depth", 'stage="requested"') == 0

    assert http.delete(f"/sandboxes/{created['id']}").status_code == 202
    wait_state(row(created["id"]), "deleted")
    after = scrape.get("/metrics", headers={"Authorization": f"Bearer {live.metrics_token}"}).text
    assert _metric(after, "hedgerow_sandboxes", f'state="deleted",tenant="{tenant.slug}"') == 1
