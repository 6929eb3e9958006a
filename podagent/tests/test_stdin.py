"""Input to a running command: ``stdin_open`` keeps its stdin a pipe the agent feeds from
``POST /operations/{id}/stdin`` (bounded; EOF on request)."""

from __future__ import annotations

import base64
import threading
import time
from typing import Any, Dict, List

from podagent import runner

from .conftest import Agent, Client, new_op_id, out


def _send(
    client: Client, op_id: str, data: bytes = b"", eof: bool = False, wait: float = 10.0
) -> Any:
    body = {"data": base64.b64encode(data).decode(), "eof": eof, "wait": wait}
    status, answer, _ = client.request("POST", f"/operations/{op_id}/stdin", body)
    return status, answer


def _background(client: Client, results: List[Dict[str, Any]], **body: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(client.exec(**body)))
    thread.start()
    return thread


def _wait_running(client: Client, op_id: str) -> None:
    # The operation exists as soon as it is claimed; waiting 0 s answers at once.
    deadline = time.monotonic() + 10
    while True:
        status, body = client.get(f"/operations/{op_id}?wait=0")
        if status == 200:
            assert body.get("status") == "running", body
            return
        assert time.monotonic() < deadline, "the operation never started"
        time.sleep(0.02)


def test_input_reaches_a_running_command_in_order_and_eof_ends_it(agent: Agent) -> None:
    op_id = new_op_id()
    results: List[Dict[str, Any]] = []
    runner_client = agent.client()
    thread = _background(
        runner_client,
        results,
        command='while read -r line; do echo "got:$line"; done; echo done',
        operation_id=op_id,
        stdin="Zmlyc3QK",  # "first\n", given up front
        stdin_open=True,
    )
    other = agent.client()
    _wait_running(other, op_id)
    status, answer = _send(other, op_id, b"second\nthi")
    assert status == 200, answer
    assert answer["accepted"] == 10 and answer["eof"] is False
    assert _send(other, op_id, b"rd\n")[0] == 200
    status, answer = _send(other, op_id, b"", eof=True)
    assert status == 200 and answer["eof"] is True
    # Closing twice is closing; more data after EOF is refused.
    assert _send(other, op_id, b"", eof=True)[0] == 200
    status, refused = _send(other, op_id, b"late\n")
    assert status == 409 and refused["error"]["code"] == "stdin_closed"
    thread.join(30)
    assert out(results[0]) == "got:first\ngot:second\ngot:third\ndone\n"
    assert results[0]["termination"]["reason"] == "exited"
    status, ended = _send(other, op_id, b"x")
    assert status == 409 and ended["error"]["code"] == "stdin_closed"
    other.close()
    runner_client.conn.close()


def test_stdin_is_refused_when_not_opened_unknown_or_malformed(agent: Agent) -> None:
    client = agent.client()
    op_id = new_op_id()
    results: List[Dict[str, Any]] = []
    thread = _background(agent.client(), results, command="sleep 0.5", operation_id=op_id)
    _wait_running(client, op_id)
    status, body = _send(client, op_id, b"x")
    assert status == 409 and body["error"]["code"] == "stdin_closed"
    thread.join(30)
    status, body = _send(client, "no-such-op", b"x")
    assert status == 404
    for bad in ({"data": "%%%"}, {"data": 5}, {"eof": "yes"}, ["x"]):
        status, body, _ = client.request("POST", f"/operations/{op_id}/stdin", bad)
        assert status == 400, bad
    # The same id with stdin_open is another request: a conflict, not a replay.
    status, conflict, _ = client.request(
        "POST", "/exec", {"operation_id": op_id, "command": "sleep 0.5", "stdin_open": True}
    )
    assert status == 409 and conflict["error"]["code"] == "operation_conflict"
    client.close()


def test_a_command_that_does_not_read_gets_a_bounded_buffer(agent: Agent) -> None:
    # The pipe holds 64 KiB; the agent holds up to STDIN_MAX_BYTES more; then 429.
    client = agent.client()
    op_id = new_op_id()
    results: List[Dict[str, Any]] = []
    thread = _background(
        agent.client(), results, command="sleep 30", operation_id=op_id, stdin_open=True
    )
    _wait_running(client, op_id)
    chunk = b"x" * (256 * 1024)
    sent = 0
    refused = None
    for _ in range(12):  # 3 MiB at most: well past pipe + buffer
        status, body = _send(client, op_id, chunk, wait=0.2)
        if status != 200:
            refused = (status, body)
            break
        sent += len(chunk)
        assert body["buffered"] <= runner.STDIN_MAX_BYTES
    assert refused is not None, "a command that never reads must not get unbounded input"
    assert refused[0] == 429 and refused[1]["error"]["code"] == "stdin_full"
    assert runner.STDIN_MAX_BYTES <= sent <= runner.STDIN_MAX_BYTES + 1024 * 1024
    status, _ = client.request("POST", f"/operations/{op_id}/cancel")[:2]
    assert status == 200
    thread.join(30)
    assert results[0]["termination"]["reason"] == "cancelled"
    client.close()


def test_a_command_that_closes_its_stdin_refuses_more_input(agent: Agent) -> None:
    client = agent.client()
    op_id = new_op_id()
    results: List[Dict[str, Any]] = []
    thread = _background(
        agent.client(),
        results,
        command="exec 0<&-; echo closed; sleep 30",
        operation_id=op_id,
        stdin_open=True,
    )
    _wait_running(client, op_id)
    # The first write after the close fails in the agent (EPIPE); from then on: 409.
    deadline = time.monotonic() + 10
    while True:
        status, body = _send(client, op_id, b"data\n")
        if status == 409:
            assert body["error"]["code"] == "stdin_closed"
            break
        assert status == 200 and time.monotonic() < deadline
        time.sleep(0.05)
    client.request("POST", f"/operations/{op_id}/cancel")
    thread.join(30)
    assert out(results[0]) == "closed\n"
    client.close()


def test_an_offset_makes_a_resend_harmless_and_a_gap_an_error(agent: Agent) -> None:
    client = agent.client()
    op_id = new_op_id()
    results: List[Dict[str, Any]] = []
    thread = _background(
        agent.client(), results, command="cat", operation_id=op_id, stdin="YWI=", stdin_open=True
    )  # "ab" up front: the input stands at offset 2
    _wait_running(client, op_id)

    def send(data: bytes, offset: int, eof: bool = False) -> Any:
        body = {"data": base64.b64encode(data).decode(), "offset": offset, "eof": eof}
        status, answer, _ = client.request("POST", f"/operations/{op_id}/stdin", body)
        return status, answer

    status, answer = send(b"cd", 2)
    assert status == 200 and answer["offset"] == 4
    status, answer = send(b"cd", 2)  # the answer was lost; the sender retries
    assert status == 200 and answer["offset"] == 4
    status, answer = send(b"xy", 7)  # a gap
    assert status == 409 and answer["error"]["code"] == "stdin_offset"
    status, answer = send(b"dXY", 3)  # overlaps and goes on: not a plain resend
    assert status == 409 and answer["error"]["code"] == "stdin_offset"
    status, answer = send(b"zz", 2)  # a stale writer's new bytes: not a resend either
    assert status == 409 and answer["error"]["code"] == "stdin_offset"
    status, answer = send(b"ef", 4, eof=True)
    assert status == 200 and answer["offset"] == 6
    thread.join(30)
    assert out(results[0]) == "abcdef"
    client.close()
