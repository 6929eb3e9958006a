"""NUL bytes through the real stack (issue 14, finding 4): output with a NUL survives
byte for byte on every exec path, the operation always ends, and a NUL in the input is
a typed 400 (docs/agent-protocol.md "Output encoding")."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.tests.live_api import api_client, ready_sandbox

pytestmark = pytest.mark.timeout(240)

# stdout a NUL b, stderr e NUL r, then a NUL-separated listing like `find -print0`.
COMMAND = "printf 'a\\000b'; printf 'e\\000r' >&2; printf 'x\\000y\\000'"
STDOUT = b"a\x00bx\x00y\x00"
STDERR = b"e\x00r"


def _bytes(meta: dict[str, Any]) -> bytes:
    """A stream record's exact bytes (its windows; nothing here is truncated)."""
    assert meta["truncated"] is False
    if meta["encoding"] == "base64":
        return base64.b64decode(meta["head"]) + base64.b64decode(meta["tail"])
    return str(meta["head"] + meta["tail"]).encode()


def _assert_exact(body: dict[str, Any]) -> None:
    """A REST operation body: typed end, the text view and the exact bytes."""
    assert (body["status"], body["termination"], body["exit_code"]) == ("completed", "exited", 0)
    assert (body["stdout"], body["stderr"]) == (STDOUT.decode(), STDERR.decode())
    assert _bytes(body["output"]["stdout"]) == STDOUT
    assert _bytes(body["output"]["stderr"]) == STDERR
    assert body["output"]["stdout"]["encoding"] == "base64"  # jsonb cannot hold U+0000


def _row(operation_id: str) -> Operation:
    op = Operation.objects.get(operation_id=operation_id)
    assert (op.status, op.termination, op.exit_code) == (OperationStatus.COMPLETED, "exited", 0)
    assert _bytes(op.stdout) == STDOUT and _bytes(op.stderr) == STDERR
    return op


def test_rest_exec_keeps_nul_bytes_on_the_fast_path_and_the_regular_path(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    # No query string: the event-loop fast path answers; with one, Django's ExecView.
    for operation_id, path in (
        ("op-nul-fast", f"/sandboxes/{sandbox_id}/exec"),
        ("op-nul-drf", f"/sandboxes/{sandbox_id}/exec?path=regular"),
    ):
        answer = http.post(path, json={"command": COMMAND, "operation_id": operation_id})
        assert answer.status_code == 200, answer.text
        _assert_exact(answer.json())
        _row(operation_id)
        fetched = http.get(f"/sandboxes/{sandbox_id}/operations/{operation_id}")
        assert fetched.status_code == 200, fetched.text
        _assert_exact(fetched.json())
        # A replay returns the stored record, not a permanent 500.
        replay = http.post(path, json={"command": COMMAND, "operation_id": operation_id})
        assert replay.status_code == 200, replay.text
        _assert_exact(replay.json())
    # A list-form command's output is no different.
    listed = http.post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": ["printf", "p\\000q"]}
    ).json()
    assert listed["stdout"] == "p\x00q" and _bytes(listed["output"]["stdout"]) == b"p\x00q"


def test_streamed_exec_keeps_nul_bytes_in_frames_and_in_the_stored_result(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    started = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": COMMAND, "stream": True, "operation_id": "op-nul-stream"},
    )
    assert started.status_code == 202, started.text
    url = live.url.replace("http://", "ws://") + started.json()["stream_url"]
    frames: list[dict[str, Any]] = []
    with connect(url, additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
        try:
            while True:
                frames.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed:
            pass
    data = {
        kind: b"".join(base64.b64decode(f["data"]) for f in frames if f["type"] == f"exec.{kind}")
        for kind in ("stdout", "stderr")
    }
    assert (data["stdout"], data["stderr"]) == (STDOUT, STDERR)
    assert frames[-1]["type"] == "exec.exit"
    _assert_exact(frames[-1]["result"])  # was: failed, exit -1 (the row's write failed)
    _row("op-nul-stream")
    fetched = http.get(f"/sandboxes/{sandbox_id}/operations/op-nul-stream")
    _assert_exact(fetched.json())


def test_orchard_exec_and_the_sdk_keep_nul_bytes(live, make_tenant):
    from hedgerow import Client
    from hedgerow.errors import ValidationError

    _, secret = make_tenant()
    sandbox_id = ready_sandbox(api_client(live, secret))
    orchard = api_client(live, secret, "/orchard")
    job = orchard.post(f"/sandboxes/{sandbox_id}/exec", json={"command": COMMAND, "wait": True})
    assert job.status_code == 200, job.text
    body = job.json()
    deadline = time.monotonic() + 60
    while body["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, body
        body = orchard.get(f"/jobs/{body['job_id']}/wait", params={"timeout": 10}).json()
    assert (body["status"], body["exit_code"], body["error"]) == ("succeeded", 0, None)
    assert (body["stdout"], body["stderr"]) == (STDOUT.decode(), STDERR.decode())
    assert body["stdout_bytes"] == len(STDOUT)

    with Client(live.url, secret) as client:
        sandbox = client.get(sandbox_id)
        result = sandbox.exec(COMMAND)
        assert (result.termination, result.exit_code) == ("exited", 0)
        assert (result.stdout, result.stderr) == (STDOUT.decode(), STDERR.decode())
        assert (result.stdout_info.head, result.stderr_info.head) == (STDOUT, STDERR)
        seen: list[str] = []
        streamed = sandbox.exec(COMMAND, on_stdout=seen.append)
        assert "".join(seen) == STDOUT.decode() and streamed.stdout_info.head == STDOUT
        # Recorded in an episode: the exec step's observation is the operation's record.
        with sandbox.episode(task_id="nul-output") as episode:
            sandbox.exec(COMMAND)
            episode.set_result(reward=1.0)
        steps = api_client(live, secret).get(f"/episodes/{episode.id}/steps").json()["results"]
        assert [s["kind"] for s in steps] == ["exec"]
        assert _bytes(steps[0]["observation"]["stdout"]) == STDOUT
        assert _bytes(steps[0]["observation"]["stderr"]) == STDERR
        closed = api_client(live, secret).get(f"/episodes/{episode.id}").json()
        assert (closed["status"], closed["resources"]["stdout_bytes"]) == ("closed", len(STDOUT))
        # A refused exec (NUL in argv) is a typed error and its step still records.
        with sandbox.episode(task_id="nul-input") as refused:
            with pytest.raises(ValidationError) as error:
                sandbox.exec(["echo", "a\x00b"])
            assert error.value.code == "validation_error"
        steps = api_client(live, secret).get(f"/episodes/{refused.id}/steps").json()["results"]
        assert steps[0]["action"] == ["echo", "a\\0b"]
        assert steps[0]["observation"]["error"]["code"] == "validation_error"


def test_a_nul_in_the_command_env_or_cwd_is_a_typed_400(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    orchard = api_client(live, secret, "/orchard")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"command": ["echo", "a\x00b"]}, "command[1]"),
        ({"command": "echo a\x00b"}, "command"),
        ({"command": "true", "env": {"K\x00": "v"}}, "env"),
        ({"command": "true", "env": {"K": "v\x00"}}, "env.K"),
        ({"command": "true", "cwd": "/tmp\x00"}, "cwd"),
    ]
    for body, field in cases:
        for path in (f"/sandboxes/{sandbox_id}/exec", f"/sandboxes/{sandbox_id}/exec?q=1"):
            for stream in (False, True):
                answer = http.post(path, json={**body, "stream": stream})
                assert answer.status_code == 400, (body, answer.text)
                error = answer.json()["error"]
                assert (error["code"], error["field"]) == ("validation_error", field), error
        refused = orchard.post(f"/sandboxes/{sandbox_id}/exec", json=body)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["code"] == "validation_error"
    assert not Operation.objects.exists()  # nothing recorded, nothing ran
