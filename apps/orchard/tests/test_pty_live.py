"""Orchard's PTY websocket frames through the real stack (web process ↔ agent PTY)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from apps.orchard.tests.live import wait_all_deleted
from apps.orchard.tests.test_contract_live import orchard, ready_sandbox, run
from apps.sandboxes.models import State
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.timeout(180)


class Pty:
    def __init__(self, live, sandbox_id: str, key: str) -> None:
        url = live.url.replace("http://", "ws://")
        self.ws = connect(f"{url}/orchard/sandboxes/{sandbox_id}/exec/pty?api_key={key}")
        self.output = b""
        self.frames: list[dict[str, Any]] = []

    def init(self, **init: Any) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "type": "init",
            "cmd": None,
            "env": {},
            "cwd": None,
            "rows": 24,
            "cols": 80,
        }
        self.send(**{**frame, **init})
        return self.next()

    def send(self, **frame: Any) -> None:
        self.ws.send(json.dumps(frame))

    def stdin(self, text: str) -> None:
        self.send(type="stdin", data=base64.b64encode(text.encode()).decode())

    def next(self) -> dict[str, Any]:
        frame = json.loads(self.ws.recv(timeout=20))
        self.frames.append(frame)
        if frame["type"] == "stdout":
            self.output += base64.b64decode(frame["data"])
        return dict(frame)

    def until(self, needle: bytes) -> None:
        deadline = time.monotonic() + 20
        while needle not in self.output:
            assert time.monotonic() < deadline, self.output
            self.next()

    def until_exit(self) -> int:
        while True:
            frame = self.next()
            if frame["type"] == "exit":
                return int(frame["code"])

    def close_code(self) -> int | None:
        try:
            while True:
                self.next()
        except ConnectionClosed:
            pass
        return self.ws.close_code


def test_it_relays_an_orchard_terminal_with_stdin_resize_signal_and_exit(live, make_tenant):
    tenant, secret = make_tenant()
    http = orchard(live, secret)
    sandbox_id = ready_sandbox(http)

    term = Pty(live, sandbox_id, secret)
    ready = term.init(cmd=["bash", "--norc", "-i"], env={"PS1": "$ "}, rows=30, cols=90)
    assert ready["type"] == "ready" and ready["pid"] > 0
    term.stdin("stty size\n")
    term.until(b"30 90")
    term.send(type="resize", rows=40, cols=100)
    term.stdin("stty size; echo $((6*7)) >&2\n")
    term.until(b"40 100")
    term.until(b"42")  # stderr is merged into stdout
    term.stdin("exit 3\n")
    assert term.until_exit() == 3
    assert term.close_code() == 1000

    term = Pty(live, sandbox_id, secret)
    term.init(cmd=["sleep", "300"])
    term.send(type="signal", sig="TERM")
    assert term.until_exit() == -15

    # A client that goes away does not leave its process running.
    term = Pty(live, sandbox_id, secret)
    pid = term.init(cmd=["sleep", "301"])["pid"]
    term.ws.close()
    deadline = time.monotonic() + 15
    while run(http, sandbox_id, command=f"kill -0 {pid}")["exit_code"] == 0:
        assert time.monotonic() < deadline, "the PTY's process outlived its websocket"
        time.sleep(0.2)
    http.delete(f"/sandboxes/{sandbox_id}")
    wait_all_deleted(tenant)


def test_it_closes_with_the_documented_codes(live, make_tenant):
    tenant, secret = make_tenant()
    _, other = make_tenant()
    http = orchard(live, secret)
    sandbox_id = ready_sandbox(http)

    assert Pty(live, sandbox_id, "hr_wrong").close_code() == 4401
    assert Pty(live, sandbox_id, "").close_code() == 4401
    assert Pty(live, sandbox_id, other).close_code() == 4404
    assert Pty(live, "no-such-box", secret).close_code() == 4404
    pending = make_sandbox(tenant, state=State.PROVISIONING)
    assert Pty(live, pending.external_id, secret).close_code() == 4409

    term = Pty(live, sandbox_id, secret)
    term.send(type="stdin", data="")
    assert term.close_code() == 4400
    assert any(f["type"] == "error" for f in term.frames)

    # A bad frame in a session is an error frame; the session goes on.
    term = Pty(live, sandbox_id, secret)
    term.init(cmd=["cat"])
    term.send(type="signal", sig="NOPE")
    assert term.next()["type"] == "error"
    term.stdin("still here\n")
    term.until(b"still here")
    term.send(type="close")
    assert term.close_code() == 1000
    http.delete(f"/sandboxes/{sandbox_id}")
    pending.delete()  # never provisioned: nothing in the backend to destroy
    wait_all_deleted(tenant)
