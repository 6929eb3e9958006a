"""Streamed exec through the real stack: REST starts it, websockets carry the frames."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from apps.sandboxes.agent_client import AgentUnreachable
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services.operations import agent_for
from apps.sandboxes.tests.live_api import api_client, ready_sandbox

pytestmark = pytest.mark.timeout(180)


def _ws(live: Any, path: str, secret: str | None) -> ClientConnection:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return connect(
        live.url.replace("http://", "ws://") + path,
        additional_headers=headers,
        open_timeout=20,
        max_size=None,
    )


def _frames(ws: Any, limit: int | None = None) -> list[dict[str, Any]]:
    """Frames until the server closes (or ``limit`` frames)."""
    out: list[dict[str, Any]] = []
    try:
        while limit is None or len(out) < limit:
            out.append(json.loads(ws.recv(timeout=60)))
    except ConnectionClosed:
        pass
    return out


def _stdout(frames: list[dict[str, Any]]) -> bytes:
    return b"".join(base64.b64decode(f["data"]) for f in frames if f["type"] == "exec.stdout")


SCRIPT = "for i in $(seq 1 40); do echo line-$i; sleep 0.02; done; echo err >&2; exit 3"
EXPECTED = "".join(f"line-{i}\n" for i in range(1, 41)).encode()


def test_it_streams_frames_in_order_across_a_forced_reconnect(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    started = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": SCRIPT, "stream": True, "operation_id": "op-stream-1"},
    )
    assert started.status_code == 202, started.text
    body = started.json()
    assert (body["id"], body["status"]) == ("op-stream-1", "running")
    path = body["stream_url"]

    with _ws(live, path, secret) as first:
        head = _frames(first, limit=6)
    # The socket was dropped mid-stream; reconnect after the last seq we saw.
    last = head[-1]["seq"]
    with _ws(live, f"{path}?after_seq={last}", secret) as second:
        tail = _frames(second)

    frames = head + tail
    seqs = [f["seq"] for f in frames]
    assert seqs == list(range(len(frames))), seqs  # contiguous: no loss, no duplicate
    assert frames[0]["type"] == "exec.start"
    assert _stdout(frames) == EXPECTED
    exit_frame = frames[-1]
    assert exit_frame["type"] == "exec.exit"
    assert exit_frame["operation_id"] == "op-stream-1"
    assert exit_frame["result"]["termination"] == "exited"
    assert exit_frame["result"]["exit_code"] == 3
    assert exit_frame["result"]["stderr"] == "err\n"
    op = Operation.objects.get(operation_id="op-stream-1")
    assert (op.status, op.exit_code) == (OperationStatus.COMPLETED, 3)


def test_it_replays_everything_to_a_late_subscriber_and_a_replay_runs_once(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    command = "echo $$ >> /workspace/runs; printf 'a\\xc3'; printf '\\xa9b'"
    body = {"command": command, "stream": True, "operation_id": "op-late"}
    assert http.post(f"/sandboxes/{sandbox_id}/exec", json=body).status_code == 202
    done = http.get(f"/sandboxes/{sandbox_id}/operations/op-late")
    for _ in range(100):
        if done.json()["status"] != "running":
            break
        done = http.get(f"/sandboxes/{sandbox_id}/operations/op-late")
    assert done.json()["status"] == "completed"

    with _ws(live, f"/ws/v1/sandboxes/{sandbox_id}/operations/op-late/stream", secret) as ws:
        frames = _frames(ws)
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    assert _stdout(frames).decode() == "aéb"  # a UTF-8 character split across chunks
    assert frames[-1]["result"]["exit_code"] == 0

    replay = http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
    assert replay.status_code == 200, replay.text  # finished replay: the stored record
    runs = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "wc -l < /workspace/runs"})
    assert runs.json()["stdout"].strip() == "1"


def test_it_recovers_an_operation_whose_relay_died(live, make_tenant):
    """The web process that pumped the stream is gone: a GET asks the agent by id."""
    from apps.sandboxes.models import Sandbox
    from apps.sandboxes.services.operations import ExecRequest, operation_start
    from apps.tenancy.principal import Principal

    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    sandbox = Sandbox.objects.get(external_id=sandbox_id)
    request = ExecRequest(command="sleep 1; echo recovered")
    # A running record with no pump, and the command running in the agent: exactly
    # what a web process that died mid-stream leaves behind.
    operation, _ = operation_start(
        principal=Principal(tenant=tenant, scopes=frozenset({"write"})),
        sandbox=sandbox,
        request=request,
        operation_id="op-orphan",
    )
    with pytest.raises(AgentUnreachable):
        agent_for(sandbox).exec(request.agent_body("op-orphan"), timeout=0.3)

    with _ws(live, f"/ws/v1/sandboxes/{sandbox_id}/operations/op-orphan/stream", secret) as ws:
        frames = _frames(ws)
    assert frames[-1]["type"] == "exec.exit"
    assert frames[-1]["result"]["stdout"] == "recovered\n"
    operation.refresh_from_db()
    assert operation.status == OperationStatus.COMPLETED
    assert operation.stdout["head"] == "recovered\n"


def test_it_never_streams_another_tenants_operation(live, make_tenant):
    _, secret = make_tenant()
    _, outsider = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    started = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": "echo private", "stream": True, "operation_id": "op-mine"},
    )
    path = started.json()["stream_url"]
    with _ws(live, path, outsider) as ws:
        frames = _frames(ws)
        assert ws.close_code == 4404
    assert [(f["type"], f["code"]) for f in frames] == [("error", "not_found")]
    with _ws(live, "/ws/realtime", outsider) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "subscribe",
                    "topic": "operation",
                    "sandbox_id": sandbox_id,
                    "operation_id": "op-mine",
                }
            )
        )
        reply = json.loads(ws.recv(timeout=20))
        assert (reply["type"], reply["code"]) == ("error", "not_found")
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(timeout=20)) == {"type": "pong"}  # still open, nothing leaked
    with _ws(live, path, None) as ws:
        frames = _frames(ws)
        assert ws.close_code == 4401
    assert frames[0]["code"] == "not_authenticated"


def test_it_streams_through_the_sdk_sync_and_async(live, make_tenant):
    import asyncio

    from hedgerow import Client
    from hedgerow.aio import AsyncClient

    _, secret = make_tenant()
    sandbox_id = ready_sandbox(api_client(live, secret))
    with Client(live.url, secret) as client:
        sandbox = client.get(sandbox_id)
        frames = list(sandbox.exec_stream("printf 'é%.0s' $(seq 1 3); echo; echo oops >&2"))
        assert frames[0].type == "start"
        assert frames[-1].type == "exit" and frames[-1].result is not None
        assert frames[-1].result.exit_code == 0
        assert b"".join(f.data for f in frames if f.type == "stdout").decode() == "ééé\n"

        seen: list[str] = []
        result = sandbox.exec("echo one; sleep 0.2; echo two", on_stdout=seen.append)
        assert "".join(seen) == "one\ntwo\n" and result.stdout == "one\ntwo\n"

        with sandbox.pty(cmd=["bash", "--norc", "--noprofile"]) as term:
            term.write(b"exit 5\n")
            while term.read(timeout=20):
                pass
            assert term.exit_code == 5

    async def run_async() -> list[str]:
        async with AsyncClient(live.url, secret) as aclient:
            asandbox = await aclient.get(sandbox_id)
            return [f.type async for f in asandbox.exec_stream("echo hi")]

    types = asyncio.run(run_async())
    assert types[0] == "start" and types[-1] == "exit" and "stdout" in types


def test_it_bounds_the_replay_buffer_and_names_the_gap(live, make_tenant, settings):
    """More frames than the buffer keeps: a late subscriber is told what it missed,
    then gets the kept tail in order, and the exit frame still has the whole-stream
    totals."""
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    # Each line is its own agent frame: the agent sends what one read of the pipe
    # returns, so a writer that only pauses between lines is read several lines at a
    # time when the agent is slow (a loaded host). This one writes the next line only
    # once the pipe is empty (FIONREAD on its end of the pipe: the agent read it).
    command = [
        "python3",
        "-c",
        "import fcntl, struct, termios, time\n"
        "def unread():\n"
        " return struct.unpack('i', fcntl.ioctl(1, termios.FIONREAD, bytes(4)))[0]\n"
        "for i in range(1, 701):\n"
        " print(f'line-{i}', flush=True)\n"
        " while unread():\n"
        "  time.sleep(0.0005)\n",
    ]
    body = {"command": command, "stream": True, "operation_id": "op-many"}
    assert http.post(f"/sandboxes/{sandbox_id}/exec", json=body).status_code == 202
    path = f"/ws/v1/sandboxes/{sandbox_id}/operations/op-many/stream"
    with _ws(live, path, secret) as ws:
        live_frames = _frames(ws)  # a subscriber from the start sees every frame
    assert [f["seq"] for f in live_frames] == list(range(len(live_frames)))
    assert len(live_frames) > settings.HEDGEROW_STREAM_REPLAY_FRAMES + 10
    assert [base64.b64decode(f["data"]) for f in live_frames if f["type"] == "exec.stdout"] == [
        f"line-{i}\n".encode() for i in range(1, 701)
    ]

    with _ws(live, path, secret) as ws:
        late = _frames(ws)
    gap = late[0]
    assert gap["type"] == "exec.gap" and gap["from_seq"] == 0
    kept = late[1:]
    assert [f["seq"] for f in kept] == list(range(gap["to_seq"] + 1, len(live_frames)))
    assert len(kept) <= settings.HEDGEROW_STREAM_REPLAY_FRAMES + 100  # MAXLEN ~ trims lazily
    assert _stdout(kept).endswith(b"line-700\n")
    assert kept[-1]["result"]["output"]["stdout"]["total_bytes"] == len(
        "".join(f"line-{i}\n" for i in range(1, 701))
    )


def test_it_streams_an_operation_and_state_over_the_browser_socket(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    with _ws(live, "/ws/realtime", secret) as ws:
        ws.send(json.dumps({"type": "subscribe", "topic": "sandboxes"}))
        assert json.loads(ws.recv(timeout=20))["type"] == "subscribed"
        sandbox_id = ready_sandbox(http)
        started = http.post(
            f"/sandboxes/{sandbox_id}/exec",
            json={"command": "echo via-realtime", "stream": True, "operation_id": "op-rt"},
        )
        assert started.status_code == 202
        ws.send(
            json.dumps(
                {
                    "type": "subscribe",
                    "topic": "operation",
                    "sandbox_id": sandbox_id,
                    "operation_id": "op-rt",
                    "after_seq": -1,
                }
            )
        )
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["type"] != "exec.exit":
            frames.append(json.loads(ws.recv(timeout=30)))
    states = [f["state"] for f in frames if f["type"] == "sandbox.state"]
    assert "ready" in states  # tenant-wide state events, sent after each commit
    exec_frames = [f for f in frames if f["type"].startswith("exec.")]
    assert [f["seq"] for f in exec_frames] == list(range(len(exec_frames)))
    assert _stdout(exec_frames) == b"via-realtime\n"
    assert exec_frames[-1]["result"]["exit_code"] == 0


def test_a_process_no_loop_serves_relays_a_stream_with_the_same_pump(live, make_tenant):
    """A Celery worker or a management command (no event loop serves it) starts a
    streamed exec: the one relay (``stream_pump``) runs on a private loop in a thread and
    stores the frames, the end and the row as the web process's relay does; its
    liveness key is given back when it ends."""
    from apps.sandboxes.models import Sandbox
    from apps.sandboxes.services import stream_pump
    from apps.sandboxes.services.operations import ExecRequest
    from apps.sandboxes.services.streaming import operation_exec_stream, pump_alive
    from apps.sandboxes.tests.faults import until
    from apps.tenancy.principal import Principal

    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    sandbox = Sandbox.objects.get(external_id=sandbox_id)
    assert stream_pump.running_loop() is None  # this test process: no serving loop
    operation, started = operation_exec_stream(
        principal=Principal(tenant=tenant, scopes=frozenset({"write"})),
        sandbox=sandbox,
        request=ExecRequest(command=SCRIPT),
        operation_id="op-no-loop",
    )
    assert started
    path = f"/ws/v1/sandboxes/{sandbox_id}/operations/op-no-loop/stream"
    with _ws(live, path, secret) as ws:
        frames = _frames(ws)
    assert _stdout(frames) == EXPECTED
    assert [f["seq"] for f in frames] == sorted({f["seq"] for f in frames})  # in order, once
    assert frames[-1]["type"] == "exec.exit"
    operation.refresh_from_db()
    assert (operation.status, operation.exit_code) == (OperationStatus.COMPLETED, 3)
    assert operation.stderr["head"] == "err\n"
    until(lambda: not pump_alive(str(operation.pk)), what="the relay to give its key back")
