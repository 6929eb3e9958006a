"""The server keeps a bounded history of a sandbox's metrics (issue 24, "per-sandbox
metrics over time"): each read is kept (at most one per the minimum gap), the newest N,
oldest first after ``?since``; a bad ``since`` is a typed 400; another team cannot read
it; the history is dropped when the sandbox is destroyed. Real sandbox, real Redis."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from apps.core.errors import ValidationFailed
from apps.core.redis_sync import redis_client
from apps.sandboxes.services.sandbox_metrics import _key, sandbox_metrics
from apps.sandboxes.tests.faults import row, wait_state
from apps.sandboxes.tests.test_files_live import _api, _error, _ready, _sh

pytestmark = pytest.mark.timeout(300)


def test_the_history_is_bounded_filtered_by_since_and_dropped_on_delete(
    live: Any, make_tenant: Any
) -> None:
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    http = _api(live, secret)
    sandbox_id = _ready(http)
    sandbox = row(sandbox_id)

    with override_settings(
        HEDGEROW_METRICS_HISTORY_MIN_GAP_S=0, HEDGEROW_METRICS_HISTORY_SAMPLES=3
    ):
        for _ in range(5):
            _sh(http, sandbox_id, "true")  # something between two readings
            assert "history" not in sandbox_metrics(sandbox=sandbox)  # only when asked
        everything = sandbox_metrics(sandbox=sandbox, since="0")
    history = everything["history"]
    # capped at 3, oldest first, the reading just taken last
    assert len(history) == 3
    assert [h["ts"] for h in history] == sorted(h["ts"] for h in history)
    assert history[-1]["ts"] == everything["ts"]
    assert set(history[0]) == {"ts", "memory_bytes", "cpu_usage_ns", "pids", "disk_bytes"}
    assert all(h["memory_bytes"] > 0 and h["pids"] >= 1 for h in history)
    assert redis_client().llen(_key(sandbox.id)) == 3

    # since: only what came after it
    later = sandbox_metrics(sandbox=sandbox, since=str(history[-1]["ts"]))["history"]
    assert all(h["ts"] > history[-1]["ts"] for h in later) and later

    # through the API, as the sandbox page asks on opening
    got = http.get(f"/sandboxes/{sandbox_id}/metrics", params={"since": history[0]["ts"] - 1})
    assert got.status_code == 200, got.text[:300]
    served = got.json()["history"]
    assert served[0]["ts"] == history[0]["ts"] and served[-1]["ts"] == got.json()["ts"]
    assert "history" not in http.get(f"/sandboxes/{sandbox_id}/metrics").json()
    for bad in ("yesterday", "-1", "nan", "inf"):
        _error(
            http.get(f"/sandboxes/{sandbox_id}/metrics", params={"since": bad}),
            400,
            "validation_error",
        )
    with pytest.raises(ValidationFailed) as refused:
        sandbox_metrics(sandbox=sandbox, since="x")
    assert refused.value.field == "since"
    _error(
        _api(live, other_secret).get(f"/sandboxes/{sandbox_id}/metrics", params={"since": "0"}),
        404,
        "sandbox_not_found",
    )

    assert http.delete(f"/sandboxes/{sandbox_id}").status_code in (200, 202, 204)
    wait_state(sandbox, "deleted")
    assert redis_client().exists(_key(sandbox.id)) == 0
