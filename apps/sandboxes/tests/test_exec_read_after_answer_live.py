"""A REST exec's answer is its record (issue 17 goal 3): once the client has the
answer, every reader — the API from another connection, the ORM, an export — sees
the finished row, on the event-loop fast path as on Django's view.

Why this is pinned: answering before Postgres confirmed the result's UPDATE saves a
round trip per exec, and a crash in between is recovered from the agent; but it was
measured (2026-12-06, docs/benchmarks.md) to leave about half of the reads made right
after the answer seeing ``running``. A client that reads what it just ran must not have
to poll for it."""

from __future__ import annotations

import pytest

from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.tests.live_api import api_client, ready_sandbox

pytestmark = pytest.mark.timeout(240)

ROUNDS = 40


def test_the_row_is_final_when_the_answer_arrives(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    # No query string: the fast path answers; with one, Django's ExecView.
    for path, label in (
        (f"/sandboxes/{sandbox_id}/exec", "fast"),
        (f"/sandboxes/{sandbox_id}/exec?path=regular", "drf"),
    ):
        for n in range(ROUNDS):
            operation_id = f"op-{label}-{n}"
            answer = http.post(path, json={"command": "echo $0", "operation_id": operation_id})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert (body["status"], body["exit_code"]) == ("completed", 0)
            # Read at once, from this process's own connection: no waiting, no retry.
            row = Operation.objects.get(operation_id=operation_id)
            assert row.status == OperationStatus.COMPLETED, (operation_id, row.status)
            assert (row.exit_code, row.stdout) == (0, body["output"]["stdout"])
            assert row.finished_at is not None
