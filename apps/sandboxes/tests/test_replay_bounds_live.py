"""Streamed exec's replay buffers cannot fill Redis: each operation keeps at most
HEDGEROW_STREAM_REPLAY_MAX_BYTES of frames, for at most HEDGEROW_STREAM_REPLAY_TTL_S
after its last frame, and a reconnecting subscriber is told what was dropped."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from apps.core.redis_sync import redis_client
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services.replay import bytes_key, frames_key
from apps.sandboxes.tests.live_api import api_client, ready_sandbox

pytestmark = pytest.mark.timeout(300)

OPS = 10
OUTPUT_BYTES = 3_000_000  # each op's stdout: ~3x the default per-operation cap
# 30 waves of 100 kB with a pause between them: the ops are still running while the
# test reads their buffers' TTLs.
COMMAND = "for i in $(seq 30); do head -c 100000 /dev/zero | tr '\\0' x; sleep 0.1; done"


def _poll(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_ten_large_streamed_ops_keep_bounded_replay_memory_with_the_documented_ttl(
    live: Any, make_tenant: Any, settings: Any
) -> None:
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    ttl_limit = settings.HEDGEROW_STREAM_REPLAY_TTL_S
    cap = settings.HEDGEROW_STREAM_REPLAY_MAX_BYTES
    assert cap * 2 < OUTPUT_BYTES  # the test only means something if the cap bites
    ids = [f"op-big-{i}" for i in range(OPS)]
    for op_id in ids:
        started = http.post(
            f"/sandboxes/{sandbox_id}/exec",
            json={"command": COMMAND, "stream": True, "operation_id": op_id},
        )
        assert started.status_code == 202, started.text
    client: Any = redis_client()  # redis-py types its sync calls as maybe-awaitable
    pks = {op_id: str(Operation.objects.get(operation_id=op_id).pk) for op_id in ids}

    # While they run: every buffer that exists expires within the documented TTL.
    running_ttls: list[int] = []
    for pk in pks.values():
        ttl = _poll(
            lambda pk=pk: client.ttl(frames_key(pk)) > 0 and client.ttl(frames_key(pk)),
            60,
            "a buffer",
        )
        running_ttls.append(int(ttl))
    assert max(running_ttls) <= ttl_limit, running_ttls

    def finished() -> bool:
        statuses = set(
            Operation.objects.filter(operation_id__in=ids).values_list("status", flat=True)
        )
        return OperationStatus.RUNNING not in statuses

    _poll(finished, 180, "the ten operations to finish")
    assert set(
        Operation.objects.filter(operation_id__in=ids).values_list("exit_code", flat=True)
    ) == {0}

    total = 0
    for pk in pks.values():
        key = frames_key(pk)
        assert 0 < client.ttl(key) <= ttl_limit
        assert 0 < client.ttl(bytes_key(pk)) <= ttl_limit
        usage = client.memory_usage(key, samples=0)
        assert usage is not None
        total += int(usage)
        # the frames' data kept is within the cap (the one newest frame may exceed it)
        data = sum(len(fields[b"f"]) for _id, fields in client.xrange(key))
        assert data <= cap + 200_000, data
    # Redis's own overhead per entry is small next to a frame's data.
    assert total <= OPS * cap * 1.25, total

    # A subscriber from the start is told which frames were dropped, then gets the
    # tail in order and the exit frame.
    path = f"/ws/v1/sandboxes/{sandbox_id}/operations/{ids[0]}/stream"
    with connect(
        live.url.replace("http://", "ws://") + path,
        additional_headers={"Authorization": f"Bearer {secret}"},
        open_timeout=20,
        max_size=None,
    ) as ws:
        frames: list[dict[str, Any]] = []
        try:
            while True:
                frames.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed:
            pass
    assert frames[0]["type"] == "exec.gap" and frames[0]["from_seq"] == 0
    kept = frames[1:-1]
    assert [f["seq"] for f in kept] == list(
        range(frames[0]["to_seq"] + 1, frames[0]["to_seq"] + 1 + len(kept))
    )
    tail = b"".join(base64.b64decode(f["data"]) for f in kept if f["type"] == "exec.stdout")
    assert 0 < len(tail) < OUTPUT_BYTES and set(tail) == {ord("x")}
    # and says exactly how much it skipped: with the tail, the whole output
    assert frames[0]["skipped"]["stdout"]["bytes"] == OUTPUT_BYTES - len(tail)
    assert frames[0]["skipped"]["stderr"] == {"bytes": 0, "lines": 0}
    assert frames[-1]["type"] == "exec.exit"
    assert frames[-1]["result"]["output"]["stdout"]["total_bytes"] == OUTPUT_BYTES
