from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from .conftest import Agent, Client, new_op_id, out


def test_it_replays_a_finished_operation_without_rerunning(client: Client, tmp_path: Path) -> None:
    marker = tmp_path / "side-effect"
    body = {"operation_id": new_op_id(), "command": f"echo run >> {marker}; echo ok"}
    first = client.exec(**body)
    second = client.exec(**body)
    assert marker.read_text() == "run\n"
    assert first["replayed"] is False and second["replayed"] is True
    assert out(second) == "ok\n"
    assert {k: v for k, v in first.items() if k != "replayed"} == {
        k: v for k, v in second.items() if k != "replayed"
    }


def test_it_runs_concurrent_duplicates_once(agent: Agent, tmp_path: Path) -> None:
    marker = tmp_path / "side-effect"
    body = {"operation_id": new_op_id(), "command": f"echo run >> {marker}; sleep 0.5; echo ok"}
    results: List[Dict[str, Any]] = []

    def post() -> None:
        c = agent.client()
        results.append(c.exec(**body))
        c.close()

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8
    assert marker.read_text() == "run\n"
    assert sorted(r["replayed"] for r in results) == [False] + [True] * 7
    assert all(out(r) == "ok\n" for r in results)


def test_it_rejects_a_different_body_for_the_same_id(client: Client) -> None:
    op_id = new_op_id()
    client.exec("echo one", operation_id=op_id)
    changes: List[Dict[str, Any]] = [{"command": "echo two"}, {"env": {"A": "b"}}, {"cwd": "/"}]
    for change in changes:
        body: Dict[str, Any] = {"operation_id": op_id, "command": "echo one"}
        body.update(change)
        status, data, _ = client.request("POST", "/exec", body)
        assert status == 409, change
        assert data["error"]["code"] == "operation_conflict"


def test_it_streams_frames_as_output_is_produced(client: Client) -> None:
    body = {"operation_id": new_op_id(), "command": "echo a; sleep 1; echo b >&2", "stream": True}
    t0 = time.monotonic()
    frames = []
    first_output_at = None
    for frame in client.stream(body):
        if frame["type"] == "stdout" and first_output_at is None:
            first_output_at = time.monotonic() - t0
        frames.append(frame)
    total = time.monotonic() - t0
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    assert [f["type"] for f in frames] == ["start", "stdout", "stderr", "exit"]
    assert frames[0]["pid"] > 0 and frames[0]["operation_id"] == body["operation_id"]
    assert first_output_at is not None and first_output_at < total - 0.5
    result = frames[-1]["result"]
    assert out(result) == "a\n" and out(result, "stderr") == "b\n"
    # The connection is still usable after the chunked response.
    assert out(client.exec("echo next")) == "next\n"


def _wait_running(client: Client, op_id: str, timeout: float = 10) -> None:
    """Until the agent knows the operation as running (404 before it is registered)."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = client.get(f"/operations/{op_id}?wait=0")
        if status == 200 and body.get("status") == "running":
            return
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.01)


def test_it_attaches_a_stream_to_a_running_operation(agent: Agent, client: Client) -> None:
    op_id = new_op_id()
    body = {"operation_id": op_id, "command": "echo a; sleep 1; echo b", "stream": True}
    first: List[Dict[str, Any]] = []
    t = threading.Thread(target=lambda: first.extend(client.stream(body)))
    t.start()
    other = agent.client()
    _wait_running(other, op_id)  # attach while it runs, not after a guessed delay
    attached = list(other.stream(body))
    t.join(30)
    assert [f["seq"] for f in attached] == list(range(len(attached)))
    assert [f["type"] for f in attached] == [f["type"] for f in first]
    assert attached[-1]["result"]["replayed"] is True
    assert out(attached[-1]["result"]) == "a\nb\n"
    # Replay of the finished op by stream: start + exit with the stored result.
    replay = list(other.stream(body))
    assert [f["type"] for f in replay] == ["start", "exit"]
    assert replay[-1]["result"]["stdout"] == first[-1]["result"]["stdout"]
    other.close()


def test_it_waits_for_an_operation(agent: Agent, client: Client) -> None:
    op_id = new_op_id()
    t = threading.Thread(target=lambda: client.exec("sleep 1; echo done", operation_id=op_id))
    t.start()
    other = agent.client()
    _wait_running(other, op_id)
    status, body = other.get(f"/operations/{op_id}?wait=0")
    assert status == 200 and body == {"operation_id": op_id, "status": "running"}
    status, body = other.get(f"/operations/{op_id}?wait=30")
    assert status == 200 and body["status"] == "completed" and out(body) == "done\n"
    t.join(30)
    status, body = other.get("/operations/unknown-op")
    assert status == 404 and body["error"]["code"] == "not_found"
    other.close()


def test_it_cancels_a_running_operation(agent: Agent, client: Client, tmp_path: Path) -> None:
    op_id = new_op_id()
    pidfile = tmp_path / "pid"
    results: List[Dict[str, Any]] = []
    t = threading.Thread(
        target=lambda: results.append(
            client.exec(f"sleep 100 & echo $! > {pidfile}; wait", operation_id=op_id)
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    other = agent.client()
    status, body, _ = other.request("POST", f"/operations/{op_id}/cancel")
    assert status == 200
    assert body["termination"]["reason"] == "cancelled"
    t.join(30)
    assert results[0]["termination"]["reason"] == "cancelled"
    from .conftest import wait_gone

    assert wait_gone([int(pidfile.read_text())])
    other.close()


def test_it_evicts_the_oldest_finished_operations_at_capacity() -> None:
    from podagent.operations import MAX_OPERATIONS, Registry

    registry = Registry()
    ops = [registry.claim(f"op-{i}", "f", 1.0)[0] for i in range(MAX_OPERATIONS)]
    for op in ops[1:]:
        op.result = {"termination": {"reason": "exited"}}
    _new, created = registry.claim("op-new", "f", 1.0)
    assert created
    # The oldest is still running: kept. The oldest finished one made room.
    assert registry.get("op-0") is ops[0]
    assert registry.get("op-1") is None and registry.get("op-2") is ops[2]
    assert registry.get("op-new") is not None
    assert len(registry._ops) == MAX_OPERATIONS
