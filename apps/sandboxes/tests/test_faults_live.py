"""Fault injection against the real stack (uvicorn, Celery worker, Postgres, Redis,
netns+bwrap sandboxes). Each scenario shows nothing is lost or duplicated, the ledger
explains what happened, and after a reconciler round the audit balances, leaked = 0.
(Scenario 4, Redis restarted mid-burst, is in test_faults_redis_live.py.)"""

from __future__ import annotations

import os
import signal
import socket
import threading
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.utils import timezone

from apps.sandboxes.agent_client import AgentClient, AgentError, agent_token
from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Operation, Sandbox, State
from apps.sandboxes.services.provisioning import sandbox_reap
from apps.sandboxes.services.recovery import operation_recover_stale
from apps.sandboxes.tests.faults import (
    api,
    create_ready,
    reconciled_audit,
    resources_of,
    row,
    transitions,
    until,
    wait_state,
)

pytestmark = pytest.mark.timeout(240)


def _agent(sandbox: Sandbox) -> AgentClient:
    assert sandbox.endpoint_port is not None
    return AgentClient(
        sandbox.endpoint_host,
        sandbox.endpoint_port,
        agent_token(sandbox.id.hex, sandbox.generation),
    )


def _agent_has_running(sandbox: Sandbox, op_id: str) -> bool:
    try:
        return _agent(sandbox).operation(op_id, wait=0).get("status") == "running"
    except AgentError:
        return False


def _exec_in_thread(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            response = http.post(url, json=body)
            outcome["status"], outcome["body"] = response.status_code, response.json()
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    outcome["thread"] = threading.Thread(target=run, daemon=True)
    outcome["thread"].start()
    return outcome


def test_it_fails_a_provision_whose_worker_died_and_leaves_nothing(
    live: Any, make_tenant: Any, settings: Any
) -> None:
    """1. The Celery worker is killed mid-provision, then restarted."""
    tenant, secret = make_tenant()
    since = timezone.now()
    live.restart_worker({"HEDGEROW_FAULTS": "provision.after_backend=sleep:120"})
    try:
        created = api(live.url, secret).post("/sandboxes", json={"image": "host"})
        assert created.status_code == 201
        sandbox = row(created.json()["id"])
        until(lambda: "process" in resources_of(sandbox), what="the sandbox's process")
        live.worker.kill()  # SIGKILL: no cleanup, no ack
    finally:
        live.restart_worker({})
    sandbox.refresh_from_db()
    assert sandbox.state == State.PROVISIONING

    settings.HEDGEROW_PENDING_TIMEOUT_S = 0  # the deadline has passed, as it would
    report = reconciled_audit(tenant=tenant, since=since)

    sandbox.refresh_from_db()
    assert sandbox.state == State.FAILED
    assert transitions(sandbox) == [
        ("provisioning", "scheduled"),
        ("failed", "provision_deadline"),
    ]
    assert resources_of(sandbox) == []
    assert report.terms["failed"] == 1
    assert report.reasons["failed"] == {"provision_deadline": 1}


def test_it_recovers_the_result_of_an_exec_whose_web_process_died(
    live: Any, make_tenant: Any
) -> None:
    """2. The web process is killed while an exec runs, then restarted."""
    tenant, secret = make_tenant()
    since = timezone.now()
    http = api(live.url, secret)
    info = create_ready(http)
    sandbox = row(info["id"])
    url = f"/sandboxes/{info['id']}/exec"
    command = "echo x >> /workspace/ran; sleep 2; echo finished"
    pending = _exec_in_thread(http, url, {"command": command, "operation_id": "op-web-died"})
    until(lambda: _agent_has_running(sandbox, "op-web-died"), what="the agent to run it")

    live.web.kill()
    live.restart_web()
    pending["thread"].join(30)
    assert "error" in pending  # the client lost its connection with the web process
    operation = Operation.objects.get(sandbox=sandbox, operation_id="op-web-died")
    assert operation.status == "running"

    # The periodic sweep, run as if the recovery delay had passed: it leaves the row
    # alone while the dead process's relay lease is still live, then asks the agent.
    def recovered() -> bool:
        operation_recover_stale(now=timezone.now() + timedelta(minutes=10))
        operation.refresh_from_db()
        return operation.status != "running"

    until(recovered, timeout=60, what="the operation to be recovered")
    assert (operation.status, operation.termination, operation.exit_code) == (
        "completed",
        "exited",
        0,
    )
    fetched = http.get(f"/sandboxes/{info['id']}/operations/op-web-died").json()
    assert fetched["stdout"] == "finished\n"
    ran = http.post(url, json={"command": "wc -l < /workspace/ran"}).json()
    assert ran["stdout"].strip() == "1"

    assert http.delete(f"/sandboxes/{info['id']}").status_code == 202
    wait_state(sandbox, State.DELETED)
    assert reconciled_audit(tenant=tenant, since=since).terms["deleted"] == 1


class _AnswerDroppingProxy:
    """Forwards one HTTP request to the agent, swallows the answer, then hangs up: the
    command ran, but the control plane never hears how it ended."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        client.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(65536)
        headers, _, body = head.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in headers.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += client.recv(65536)
        upstream.sendall(headers + b"\r\n\r\n" + body)
        upstream.settimeout(10)
        upstream.recv(65536)  # the answer arrives ... and is dropped
        client.close()
        upstream.close()
        self.listener.close()


def test_it_never_runs_a_command_twice_when_its_answer_was_lost(
    live: Any, make_tenant: Any
) -> None:
    """3. The response is lost between the agent and the control plane."""
    tenant, secret = make_tenant()
    since = timezone.now()
    http = api(live.url, secret)
    info = create_ready(http)
    sandbox = row(info["id"])
    assert sandbox.endpoint_port is not None
    proxy = _AnswerDroppingProxy((sandbox.endpoint_host, sandbox.endpoint_port))
    real = {"endpoint_host": sandbox.endpoint_host, "endpoint_port": sandbox.endpoint_port}
    Sandbox.objects.filter(pk=sandbox.pk).update(
        endpoint_host="127.0.0.1", endpoint_port=proxy.port
    )
    url = f"/sandboxes/{info['id']}/exec"
    body = {"command": "echo x >> /workspace/ran; echo once", "operation_id": "op-lost-answer"}

    first = http.post(url, json=body)
    proxy.thread.join(10)
    Sandbox.objects.filter(pk=sandbox.pk).update(**real)
    retried = http.post(url, json=body)

    assert first.status_code == 502
    assert first.json()["error"]["code"] == "agent_unreachable"
    assert retried.status_code == 200, retried.text
    assert (retried.json()["status"], retried.json()["stdout"]) == ("completed", "once\n")
    assert Operation.objects.filter(operation_id="op-lost-answer").count() == 1
    count = http.post(url, json={"command": "wc -l < /workspace/ran"}).json()["stdout"]
    assert count.strip() == "1"

    assert http.delete(f"/sandboxes/{info['id']}").status_code == 202
    wait_state(sandbox, State.DELETED)
    reconciled_audit(tenant=tenant, since=since)


def test_it_marks_a_sandbox_whose_agent_was_killed_lost_and_refuses_work(
    live: Any, make_tenant: Any
) -> None:
    """5. The agent process inside a sandbox is killed."""
    tenant, secret = make_tenant()
    since = timezone.now()
    http = api(live.url, secret)
    info = create_ready(http)
    sandbox = row(info["id"])
    pid = next(
        int(i.name)
        for i in get_backend().inventory()
        if i.sandbox_id == sandbox.id.hex and i.kind == "process"
    )

    os.kill(pid, signal.SIGKILL)
    until(lambda: "process" not in resources_of(sandbox), what="the agent to die")
    report = reconciled_audit(tenant=tenant, since=since)

    sandbox.refresh_from_db()
    assert sandbox.state == State.LOST
    assert transitions(sandbox)[-1] == ("lost", "resource_missing")
    assert report.terms["lost"] == 1
    assert resources_of(sandbox) == []
    url = f"/sandboxes/{info['id']}/exec"
    for body in ({"command": "true"}, {"command": "true", "generation": info["generation"]}):
        refused = http.post(url, json=body)
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "sandbox_lost"


def test_it_ends_a_running_exec_typed_when_its_sandbox_is_deleted(
    live: Any, make_tenant: Any
) -> None:
    """6. Delete while an exec is running."""
    tenant, secret = make_tenant()
    since = timezone.now()
    http = api(live.url, secret)
    info = create_ready(http)
    sandbox = row(info["id"])
    url = f"/sandboxes/{info['id']}/exec"
    pending = _exec_in_thread(http, url, {"command": "sleep 60", "operation_id": "op-cut"})
    until(lambda: _agent_has_running(sandbox, "op-cut"), what="the agent to run it")

    assert http.delete(f"/sandboxes/{info['id']}").status_code == 202
    pending["thread"].join(60)

    assert pending.get("status") == 409, pending
    assert pending["body"]["error"]["code"] == "sandbox_terminating"
    operation = Operation.objects.get(sandbox=sandbox, operation_id="op-cut")
    assert operation.status == "failed"
    assert operation.error is not None and operation.error["code"] == "sandbox_terminating"
    wait_state(sandbox, State.DELETED)
    assert resources_of(sandbox) == []
    assert reconciled_audit(tenant=tenant, since=since).terms["deleted"] == 1


def test_it_reaps_a_sandbox_whose_client_disappeared_with_the_reason(
    live: Any, make_tenant: Any
) -> None:
    """7. A client disappears without deleting its sandbox."""
    tenant, secret = make_tenant()
    since = timezone.now()
    http = api(live.url, secret)
    info = create_ready(http, heartbeat_timeout_s=5)
    sandbox = row(info["id"])

    # No heartbeat ever comes; the reaper runs as it would after the timeout.
    counts = sandbox_reap(now=timezone.now() + timedelta(seconds=10))

    assert counts["heartbeat_expired"] == 1
    wait_state(sandbox, State.DELETED)
    assert ("terminating", "heartbeat_expired") in transitions(sandbox)
    assert resources_of(sandbox) == []
    report = reconciled_audit(tenant=tenant, since=since)
    assert (report.terms["reaped_heartbeat"], report.terms["deleted"]) == (1, 0)
