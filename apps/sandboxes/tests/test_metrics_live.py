"""GET /api/v1/sandboxes/<id>/metrics on a real sandbox: the counters come from its
cgroups (memory grows by what a process allocates, pids count a background process,
CPU time grows with work) and its disk quota (a committed write), another team's
sandbox is not found, and a sandbox that is not ready has none (409 sandbox_not_ready)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from apps.sandboxes.backends import get_backend
from apps.sandboxes.tests.test_files_live import _api, _error, _ready, _sh

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
# Allocates (and touches) 96 MiB, then says so through the FIFO and waits for a signal:
# the exec returns once the FIFO is read, i.e. once the memory is held (no sleeps).
HOLD = (
    "mkfifo /tmp/held || exit 1; "
    "setsid python3 -c \"import signal; b = b'x' * (96 << 20); "
    "open('/tmp/held', 'w').write('held'); signal.pause()\" "
    ">/dev/null 2>&1 </dev/null & cat /tmp/held"
)


def _sample(http: httpx.Client, sandbox_id: str) -> dict[str, Any]:
    got = http.get(f"/sandboxes/{sandbox_id}/metrics")
    assert got.status_code == 200, got.text[:300]
    body: dict[str, Any] = got.json()
    assert body["sandbox"] == sandbox_id
    return body


def test_metrics_follow_what_the_sandbox_does(live: Any, make_tenant: Any) -> None:
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    http = _api(live, secret)
    sandbox_id = _ready(http)

    before = _sample(http, sandbox_id)
    assert before["memory_bytes"] > 0 and before["pids"] >= 1, before
    assert before["memory_limit_bytes"] == 512 * MIB and before["cpu_millis"] > 0
    assert before["cpu_source"] in ("cgroup", "proc")

    assert _sh(http, sandbox_id, HOLD) == "held"
    held = _sample(http, sandbox_id)
    assert held["memory_bytes"] >= before["memory_bytes"] + 64 * MIB, (before, held)
    assert held["pids"] > before["pids"], (before, held)
    assert held["ts"] > before["ts"]

    # a bounded amount of work, waited for by its shell and the agent: CPU time grows
    _sh(http, sandbox_id, "python3 -c 'sum(range(3 * 10**7))'")
    worked = _sample(http, sandbox_id)
    assert worked["cpu_usage_ns"] > held["cpu_usage_ns"] + 50_000_000, (held, worked)

    # disk: what the sandbox's quota group references, once the write is committed
    _sh(http, sandbox_id, "head -c 8M /dev/urandom > /workspace/blob && sync -f /workspace/blob")
    wrote = _sample(http, sandbox_id)
    if getattr(get_backend(), "storage", None) is None:  # unbounded storage: no quota
        assert before["disk_bytes"] is None and wrote["disk_bytes"] is None, wrote
    else:
        assert wrote["disk_bytes"] >= before["disk_bytes"] + 8 * MIB, (before, wrote)

    outsider = _api(live, other_secret)
    _error(outsider.get(f"/sandboxes/{sandbox_id}/metrics"), 404, "sandbox_not_found")
    _error(http.get("/sandboxes/sbx_doesnotexist/metrics"), 404, "sandbox_not_found")

    assert http.delete(f"/sandboxes/{sandbox_id}").status_code in (200, 202, 204)
    _error(http.get(f"/sandboxes/{sandbox_id}/metrics"), 409, "sandbox_not_ready")
