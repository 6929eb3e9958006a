"""Interactive terminals through the real stack: websocket ↔ web process ↔ agent PTY."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from apps.sandboxes.tests.live_api import api_client, ready_sandbox
from apps.sandboxes.tests.test_streaming_live import _frames, _ws

pytestmark = pytest.mark.timeout(180)


class Term:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.output = b""
        self.events: list[dict[str, Any]] = []

    def init(self, **init: Any) -> int:
        self.ws.send(json.dumps({"type": "pty.init", **init}))
        ready = json.loads(self.ws.recv(timeout=20))
        assert ready["type"] == "pty.ready", ready
        return int(ready["pid"])

    def send(self, **frame: Any) -> None:
        self.ws.send(json.dumps(frame))

    def pump(self, timeout: float = 15) -> None:
        message = self.ws.recv(timeout=timeout)
        if isinstance(message, bytes):
            self.output += message
        else:
            self.events.append(json.loads(message))

    def until(self, needle: bytes) -> None:
        deadline = time.monotonic() + 20
        while needle not in self.output:
            assert time.monotonic() < deadline, self.output
            self.pump()

    def until_exit(self) -> int:
        deadline = time.monotonic() + 20
        while not any(e["type"] == "pty.exit" for e in self.events):
            assert time.monotonic() < deadline, (self.output, self.events)
            self.pump()
        return int(next(e for e in self.events if e["type"] == "pty.exit")["code"])


def _alive(http: Any, sandbox_id: str, pid: int) -> bool:
    ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": f"kill -0 {pid}"})
    return bool(ran.json()["exit_code"] == 0)


def _wait_running(http: Any, sandbox_id: str, command: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        ran = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": ["pgrep", "-f", command]})
        if ran.json()["exit_code"] == 0:
            return
        assert time.monotonic() < deadline, f"{command!r} never started"
        time.sleep(0.1)


def test_it_relays_a_shell_with_resize_ctrl_c_utf8_and_exit_code(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    with _ws(live, f"/ws/v1/sandboxes/{sandbox_id}/pty", secret) as ws:
        term = Term(ws)
        term.init(rows=24, cols=80, cmd=["bash", "--norc", "--noprofile", "-i"])
        ws.send("echo hé-$((40+2))\n".encode())  # stdin as a binary frame
        term.until("hé-42".encode())
        term.send(type="pty.resize", rows=33, cols=101)
        ws.send(b"stty size\n")
        term.until(b"33 101")
        ws.send(b"sleep 301\n")
        _wait_running(http, sandbox_id, "sleep 301")
        ws.send(b"\x03")  # Ctrl-C as a terminal sends it
        ws.send(b"echo after-$?\n")
        term.until(b"after-130")  # the sleep died of SIGINT, the shell lives on
        ws.send(b"sleep 302\n")
        _wait_running(http, sandbox_id, "sleep 302")
        term.send(type="pty.signal", signal="INT")
        ws.send(b"echo again-$?\n")
        term.until(b"again-130")
        term.send(type="pty.stdin", data="ZXhpdCA3Cg==")  # "exit 7\n"
        assert term.until_exit() == 7
        with pytest.raises(ConnectionClosed):
            term.pump()
        assert ws.close_code == 1000


def test_it_kills_the_session_when_the_client_disconnects(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    with _ws(live, f"/ws/v1/sandboxes/{sandbox_id}/pty", secret) as ws:
        term = Term(ws)
        shell = term.init(cmd=["bash", "--norc", "--noprofile", "-i"])
        ws.send(b'sleep 1000 & echo "chi""ld=$!."\n')  # the echoed line does not match
        term.until(b"\r\nchild=")
        term.until(b".\r\n")
        child = int(term.output.split(b"\r\nchild=")[1].split(b".")[0])
        assert _alive(http, sandbox_id, shell) and _alive(http, sandbox_id, child)
    # The websocket is gone without a close frame for the shell: nothing may survive.
    deadline = time.monotonic() + 15
    while _alive(http, sandbox_id, shell) or _alive(http, sandbox_id, child):
        assert time.monotonic() < deadline, "PTY processes outlived the websocket"
        time.sleep(0.2)


def test_it_bounds_terminals_and_rejects_bad_frames_and_outsiders(live, make_tenant):
    _, secret = make_tenant()
    _, outsider = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    path = f"/ws/v1/sandboxes/{sandbox_id}/pty"

    with _ws(live, path, outsider) as ws:
        frames = _frames(ws)
        assert ws.close_code == 4404
    assert frames == [
        {"type": "error", "code": "sandbox_not_found", "message": frames[0]["message"],
         "field": None}
    ]  # fmt: skip

    with _ws(live, path, secret) as ws:
        ws.send(b"before init")
        frames = _frames(ws)
        assert ws.close_code == 4400
    assert frames[0]["code"] == "bad_frame"

    with _ws(live, path, secret) as ws:
        Term(ws).init(cmd=["cat"])
        ws.send("{not json")
        frames = _frames(ws)
        assert ws.close_code == 4400
    assert frames[-1]["code"] == "bad_frame"

    with _ws(live, path, secret) as ws:
        Term(ws).init(cmd=["cat"])
        ws.send(json.dumps({"type": "pty.resize", "rows": "x", "cols": 3}))
        error = json.loads(ws.recv(timeout=20))
        assert (error["code"], error["field"]) == ("bad_frame", "rows")

    # The stack runs with the default bound of 4 terminals per sandbox.
    opened = [_ws(live, path, secret) for _ in range(4)]
    for ws in opened:
        Term(ws).init(cmd=["cat"])
    with _ws(live, path, secret) as ws:
        frames = _frames(ws)
        assert ws.close_code == 4409
    assert (frames[0]["code"], frames[0]["limit"]) == ("pty_limit", 4)
    opened.pop().close()
    with _ws(live, path, secret) as ws:
        Term(ws).init(cmd=["cat"])  # a closed terminal frees its slot at once
    for ws in opened:
        ws.close()

    flood = [json.dumps({"type": "pty.resize", "rows": 10, "cols": 10})] * 500
    with _ws(live, path, secret) as ws:
        Term(ws).init(cmd=["cat"])
        try:
            for frame in flood:
                ws.send(frame)
        except ConnectionClosed:
            pass
        frames = _frames(ws)
        assert ws.close_code == 4429
    assert frames[-1]["code"] == "rate_limited"
    assert http.get(f"/sandboxes/{sandbox_id}").json()["state"] == "ready"
