"""envd PTY processes through the real e2b SDK: echo, resize, exit and kill."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from e2b import CommandExitException, NotFoundException, PtySize, Sandbox

from apps.e2b.tests.live import opts, wait_all_deleted

pytestmark = pytest.mark.timeout(240)


def _wait_for(output: list[bytes], text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in b"".join(output).decode(errors="replace"):
        assert time.monotonic() < deadline, b"".join(output)
        time.sleep(0.05)


def test_it_opens_a_terminal_echoes_resizes_and_exits(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    output: list[bytes] = []
    outcome: dict[str, Any] = {}
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=120)
    assert handle.pid > 0

    def wait() -> None:
        try:
            outcome["result"] = handle.wait(on_pty=output.append)
        except CommandExitException as exc:
            outcome["exit"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    sbx.pty.send_stdin(handle.pid, b"echo hel''lo-pty; stty size\n")
    _wait_for(output, "hello-pty")
    _wait_for(output, "24 80")
    sbx.pty.resize(handle.pid, PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(handle.pid, b"stty size; exit 3\n")
    waiter.join(60)
    assert "40 100" in b"".join(output).decode(errors="replace")
    assert outcome["exit"].exit_code == 3
    # the terminal has ended: input to it is not found
    with pytest.raises(NotFoundException):
        sbx.pty.send_stdin(handle.pid, b"echo late\n")
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_kills_a_terminal(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=120)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["result"] = handle.wait()
        except CommandExitException as exc:
            outcome["exit"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert sbx.pty.kill(handle.pid) is True
    waiter.join(60)
    assert not waiter.is_alive()
    assert "exit" in outcome and outcome["exit"].exit_code != 0
    assert sbx.pty.kill(handle.pid) is False
    sbx.kill()
    wait_all_deleted(tenant)
