"""Issue 22, "Verifier health per task": Hedgerow runs a task's verifier itself on the
initial state and on the registered reference solution, in a real sandbox made through
the create path, once per (task version, image digest, verifier version), and deletes
that sandbox. Real stack: the Celery worker runs the check, the local backend runs the
commands (host image)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.billing.quotas import quota_get
from apps.datasets.models import ReferenceRun
from apps.sandboxes.models import Operation, OperationStatus, Sandbox, SandboxEvent, State
from apps.sandboxes.services.audit import AuditSlice, audit_compute

pytestmark = pytest.mark.timeout(300)

SOLUTION = "def add(a, b):\n    return a + b\n"
# The verifier imports the policy's module; it writes a JSON result file (the verifier
# contract's per-test vector) and exits 1 when a test failed.
CHECK = r"""
import json, sys
sys.path.insert(0, '/workspace')
results = {}
try:
    import solution
    results['t::imports'] = 'passed'
    results['t::adds'] = 'passed' if solution.add(2, 3) == 5 else 'failed'
except Exception:
    results['t::imports'] = 'failed'
results['t::slow'] = 'skipped'
json.dump({'results': results}, open('/workspace/report.json', 'w'))
sys.exit(0 if all(v != 'failed' for v in results.values()) else 1)
"""
PATCH = """--- a/solution.py
+++ b/solution.py
@@ -0,0 +1,2 @@
+def add(a, b):
+    return a + b
"""


@pytest.fixture(autouse=True)
def _settled(live):
    yield
    deadline = time.monotonic() + 60
    busy = (State.REQUESTED, State.PROVISIONING, State.TERMINATING)
    while Sandbox.objects.filter(state__in=busy).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _reference(verifier: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {
        "image": "host",
        "task_version": "v1",
        "verifier": {"kind": "custom", "version": "1", "timeout": 60, **verifier},
        "solution": {"files": {"/workspace/solution.py": SOLUTION}},
        **over,
    }


GOOD = {"command": ["python3", "-c", CHECK], "report_path": "/workspace/report.json"}


def _checked(tenant: Any, task_id: str, *, timeout: float = 180) -> ReferenceRun:
    """The task's latest check once it is done or error (the worker runs it)."""
    deadline = time.monotonic() + timeout
    while True:
        run = (
            ReferenceRun.objects.filter(tenant=tenant, task_id=task_id, source="check")
            .order_by("-recorded_at", "-id")
            .first()
        )
        if run is not None and run.status in ("done", "error"):
            return run
        assert time.monotonic() < deadline, f"check of {task_id} still {run and run.status}"
        time.sleep(0.2)


def _deleted_by_the_check(tenant: Any, run: ReferenceRun) -> Sandbox:
    sandbox = Sandbox.objects.get(tenant=tenant, external_id=run.detail["sandbox_id"])
    assert sandbox.labels == {"hedgerow-reference-check": str(run.pk)}
    # the delete is recorded before the run is marked done: no wait needed
    assert sandbox.state in (State.TERMINATING, State.DELETED)
    deleted = SandboxEvent.objects.get(sandbox=sandbox, to_state=State.TERMINATING)
    assert (deleted.reason, deleted.actor) == ("reference_check_done", run.recorded_by)
    assert SandboxEvent.objects.filter(sandbox=sandbox, event="created").exists()
    return sandbox


def test_a_good_reference_is_checked_once_per_key_in_a_sandbox_that_is_deleted(
    live, make_tenant, api_client
):
    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    client, other = api_client(secret), api_client(other_secret)
    started = timezone.now()

    # registration with a reference queues the check
    put = client.put("/api/v1/tasks/adder", {"reference": _reference(GOOD)}, format="json")
    assert put.status_code == 201, put.content
    body = put.json()
    assert body["reference_check"]["status"] == "queued"
    assert body["reference"]["solution"] == {
        "files": ["/workspace/solution.py"],
        "bytes": len(SOLUTION.encode()),
    }
    assert SOLUTION not in put.content.decode()  # the solution's content is not echoed

    run = _checked(tenant, "adder")
    assert run.status == "done", run.detail
    assert (run.initial_outcome, run.reference_outcome) == ("fail", "pass")
    initial, reference = run.detail["initial"], run.detail["reference"]
    assert (initial["exit_code"], reference["exit_code"]) == (1, 0)
    assert initial["results"] == {"t::imports": "failed", "t::slow": "skipped"}
    assert reference["results"] == {
        "t::imports": "passed",
        "t::adds": "passed",
        "t::slow": "skipped",
    }
    assert reference["summary"] == {"passed": 2, "failed": 0, "error": 0, "skipped": 1}
    assert reference["report"]["format"] == "json" and reference["duration_s"] > 0
    assert (run.task_version, run.image_digest, run.verifier_version) == ("v1", "", "1")
    _deleted_by_the_check(tenant, run)
    health = client.get("/api/v1/tasks/adder/difficulty").json()
    assert (health["verifier_suspect"], health["quarantine"]) == (False, False)
    got = client.get("/api/v1/tasks/adder/reference-check")
    assert got.status_code == 200 and got.json()["status"] == "done"
    assert got.json()["detail"]["reference"]["exit_code"] == 0

    # the same key again, by the endpoint or by registering again: the cached run, no
    # sandbox made
    sandboxes = Sandbox.objects.filter(tenant=tenant).count()
    again = client.post("/api/v1/tasks/adder/reference-check")
    assert again.status_code == 200, again.content
    assert again.json()["recorded_at"] == got.json()["recorded_at"]
    assert again.json()["detail"]["sandbox_id"] == run.detail["sandbox_id"]
    put = client.put("/api/v1/tasks/adder", {"reference": _reference(GOOD)}, format="json")
    assert put.status_code == 200 and put.json()["reference_check"]["status"] == "done"
    assert Sandbox.objects.filter(tenant=tenant).count() == sandboxes
    assert ReferenceRun.objects.filter(tenant=tenant, task_id="adder").count() == 1

    # another team: 404 on both, nothing made
    assert other.post("/api/v1/tasks/adder/reference-check").status_code == 404
    assert other.get("/api/v1/tasks/adder/reference-check").status_code == 404
    assert (
        Sandbox.objects.exclude(tenant=tenant)
        .filter(labels__has_key="hedgerow-reference-check")
        .count()
        == 0
    )

    # a new task version is a new key: checked again, here with the reference as a patch
    v2 = _reference(GOOD, task_version="v2", solution={"patch": PATCH, "cwd": "/workspace"})
    put = client.put("/api/v1/tasks/adder", {"reference": v2}, format="json")
    assert put.status_code == 200 and put.json()["reference_check"]["status"] == "queued"
    run2 = _checked(tenant, "adder")
    assert run2.task_version == "v2" and run2.status == "done", run2.detail
    assert (run2.initial_outcome, run2.reference_outcome) == ("fail", "pass")
    assert run2.detail["apply"] == {"patch": "applied"}
    assert _deleted_by_the_check(tenant, run2).pk != _deleted_by_the_check(tenant, run).pk
    assert Sandbox.objects.filter(tenant=tenant).count() == sandboxes + 1

    # the reclaim-leak audit: both check sandboxes were created and deleted, none leaked
    deadline = time.monotonic() + 60
    while Sandbox.objects.filter(tenant=tenant).exclude(state=State.DELETED).exists():
        assert time.monotonic() < deadline, "a check sandbox was never destroyed"
        time.sleep(0.2)
    report = audit_compute(
        period_start=started,
        period_end=timezone.now() + timedelta(seconds=1),
        audit_slice=AuditSlice(tenant=tenant),
    )
    assert report.created == 2 and report.inventory_error == ""
    assert (report.terms["deleted"], report.terms["live"], report.terms["leaked"]) == (2, 0, 0)


def test_a_verifier_that_fails_the_reference_or_passes_the_initial_state_is_suspect(
    live, make_tenant, api_client, make_user
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    cases = {
        # not found: exit 127 on both runs
        "missing": _reference({"command": "/workspace/no-such-verifier"}),
        # passes anything, the initial state included
        "lenient": _reference({"command": ["true"]}),
    }
    for task_id, reference in cases.items():
        put = client.put(f"/api/v1/tasks/{task_id}", {"reference": reference}, format="json")
        assert put.status_code == 201, put.content
    missing, lenient = _checked(tenant, "missing"), _checked(tenant, "lenient")
    assert (missing.status, missing.initial_outcome, missing.reference_outcome) == (
        "done",
        "error",
        "error",
    )
    assert missing.detail["reference"]["exit_code"] == 127
    assert "not found" in missing.detail["reference"]["why"]
    assert (lenient.status, lenient.initial_outcome, lenient.reference_outcome) == (
        "done",
        "pass",
        "pass",
    )
    for run in (missing, lenient):
        _deleted_by_the_check(tenant, run)

    quarantine = {q["task_id"]: q for q in client.get("/api/v1/tasks/quarantine").json()["results"]}
    assert set(quarantine) == {"missing", "lenient"}
    assert [f["rule"] for f in quarantine["missing"]["evidence"]] == ["verifier_fails_reference"]
    fact = quarantine["missing"]["evidence"][0]
    assert (fact["source"], fact["exit_code"], fact["sandbox_id"]) == (
        "check",
        127,
        missing.detail["sandbox_id"],
    )
    assert quarantine["missing"]["reference_run"]["detail"]["reference"]["exit_code"] == 127
    rules = [f["rule"] for f in quarantine["lenient"]["evidence"]]
    assert rules == ["verifier_passes_initial_state"]
    assert quarantine["lenient"]["reference_run"]["initial_outcome"] == "pass"

    # an episode of a suspect task is verifier, whatever its verifier said
    opened = client.post("/api/v1/episodes", {"task_id": "missing"}, format="json").json()
    closed = client.post(
        f"/api/v1/episodes/{opened['id']}/close",
        {"termination_reason": "submitted", "verifier_outcome": "pass", "reward": 1.0},
        format="json",
    ).json()
    assert closed["failure_class"] == "verifier"

    # the dashboard's quarantine list shows the run as evidence
    make_user("refowner", (tenant, "owner"))
    browser = Client()
    assert browser.login(username="refowner", password="refowner")
    page = browser.get("/datasets/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-task-id="missing"' in html and 'data-task-id="lenient"' in html
    assert "(exit 127)" in html and missing.detail["sandbox_id"] in html


def test_a_check_that_breaks_on_its_own_is_an_error_never_evidence(live, make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    quota = quota_get(tenant=tenant)
    quota.max_concurrent_sandboxes = 0
    quota.save()
    put = client.put("/api/v1/tasks/starved", {"reference": _reference(GOOD)}, format="json")
    assert put.status_code == 201, put.content
    run = _checked(tenant, "starved")
    assert run.status == "error" and "quota" in run.detail["error"], run.detail
    assert (run.initial_outcome, run.reference_outcome) == ("", "")
    assert not Sandbox.objects.filter(tenant=tenant).exists()
    health = client.get("/api/v1/tasks/starved/difficulty").json()
    assert (health["verifier_suspect"], health["quarantine"]) == (False, False)
    assert client.get("/api/v1/tasks/quarantine").json()["results"] == []

    # a broken check is run again on request (and now the quota admits it)
    quota.max_concurrent_sandboxes = None
    quota.save()
    again = client.post("/api/v1/tasks/starved/reference-check")
    assert again.status_code == 202 and again.json()["status"] == "queued"
    run = _checked(tenant, "starved")
    assert (run.status, run.reference_outcome) == ("done", "pass"), run.detail
    assert ReferenceRun.objects.filter(tenant=tenant, task_id="starved").count() == 1

    # a check left running by a worker that died is not the cache forever: once older
    # than the task's time limit, the key is checked again
    ReferenceRun.objects.filter(pk=run.pk).update(
        status="running", recorded_at=timezone.now() - timedelta(hours=2)
    )
    quota.max_concurrent_sandboxes = 0  # (so the new check ends quickly, as an error)
    quota.save()
    stale = client.post("/api/v1/tasks/starved/reference-check")
    assert stale.status_code == 202 and stale.json()["status"] == "queued"
    assert _checked(tenant, "starved").status == "error"
    fresh = client.post("/api/v1/tasks/starved/reference-check")  # error: again
    assert fresh.status_code == 202
    assert _checked(tenant, "starved").status == "error"
    ReferenceRun.objects.filter(pk=run.pk).update(status="running")
    assert client.post("/api/v1/tasks/starved/reference-check").status_code == 200


def test_a_sandbox_lost_mid_check_is_an_error_not_a_broken_verifier(live, make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    # fails the initial state at once; on the reference it blocks until killed (the
    # last run: nothing after it would notice the sandbox is gone)
    command = ["sh", "-c", "test -f /workspace/solution.py || exit 1; sleep 120"]
    slow = _reference({"command": command, "timeout": 150})
    assert client.put("/api/v1/tasks/lost", {"reference": slow}, format="json").status_code == 201
    # another client deletes the check's sandbox while the verifier runs: its command
    # is killed with the sandbox, which says nothing about the verifier
    deadline = time.monotonic() + 120
    while not Operation.objects.filter(
        tenant=tenant, status=OperationStatus.RUNNING, request__command=command
    ).exists():
        assert time.monotonic() < deadline, "the check's verifier never started"
        time.sleep(0.2)
    sandbox = Sandbox.objects.get(tenant=tenant)
    assert client.delete(f"/api/v1/sandboxes/{sandbox.external_id}").status_code in (200, 202)
    run = _checked(tenant, "lost")
    assert run.status == "error", run.detail
    assert run.detail["initial"]["outcome"] == "fail" and "reference" not in run.detail
    assert "went away" in run.detail["error"] or "sandbox_" in run.detail["error"], run.detail
    health = client.get("/api/v1/tasks/lost/difficulty").json()
    assert (health["verifier_suspect"], health["quarantine"]) == (False, False)
    # the ledger: deleted by the other client, not by the check
    deleted = SandboxEvent.objects.get(sandbox=sandbox, to_state=State.TERMINATING)
    assert deleted.reason != "reference_check_done"


def test_bad_references_are_refused_and_nothing_is_registered(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    bad = {
        "reference.solution": _reference(GOOD, solution={}),
        "reference.verifier.kind": _reference({**GOOD, "kind": "mocha"}),
        "reference.verifier.timeout": _reference({**GOOD, "timeout": 0}),
        "reference.verifier.report_path": _reference({**GOOD, "report_path": "report.json"}),
        "reference.verifier.command": _reference({"command": []}),
    }
    for field, reference in bad.items():
        refused = client.put("/api/v1/tasks/bad", {"reference": reference}, format="json")
        assert refused.status_code == 400, (field, refused.content)
        assert refused.json()["error"]["field"] == field
    big = _reference(GOOD, solution={"files": {"/workspace/a": "x" * (256 * 1024 + 1)}})
    refused = client.put("/api/v1/tasks/bad", {"reference": big}, format="json")
    assert refused.status_code == 400
    assert client.get("/api/v1/tasks/bad").status_code == 404
    # a task without a reference has nothing to check
    assert client.put("/api/v1/tasks/plain", {}, format="json").status_code == 201
    none = client.post("/api/v1/tasks/plain/reference-check")
    assert none.status_code == 400 and none.json()["error"]["code"] == "no_reference"
    assert client.post("/api/v1/tasks/nope/reference-check").status_code == 404
    # a read-only key may look, not make sandboxes
    _, read_secret = make_tenant(scopes=["read"])
    reader = api_client(read_secret)
    assert reader.post("/api/v1/tasks/plain/reference-check").status_code == 403
    put = reader.put("/api/v1/tasks/x", {"reference": _reference(GOOD)}, format="json")
    assert put.status_code == 403
    assert not ReferenceRun.objects.exists() and not Sandbox.objects.exists()
