"""Ctrl-C at any moment of a create leaves nothing running (issue 26 defect 1).

The SDK and the CLI run as subprocesses behind a proxy that holds create requests
(before or after the server has seen them), so the SIGINT lands exactly while a create
is in flight: at a point the test observes, not after a sleep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import httpx
import pytest

from apps.orchard.tests.live import wait_all_deleted
from apps.sandboxes.models import Sandbox, State

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]
GONE = (State.TERMINATING, State.DELETED, State.FAILED, State.LOST)


def _until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _HoldingProxy:
    """Forwards HTTP to the stack; holds each ``POST /sandboxes`` either before
    forwarding it (``hold="request"``: the server has not seen it) or after
    (``hold="response"``: created, the client has no answer) until ``release``."""

    def __init__(self, upstream: str, hold: str) -> None:
        self.arrived = 0  # creates received from the client
        self.forwarded = 0  # creates the server has answered
        self.deletes: list[str] = []
        self._gate = threading.Semaphore(0)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                is_create = self.command == "POST" and self.path == "/api/v1/sandboxes"
                if self.command == "DELETE":
                    with proxy._lock:
                        proxy.deletes.append(self.path.rsplit("/", 1)[-1])
                if is_create:
                    with proxy._lock:
                        proxy.arrived += 1
                    if hold == "request":
                        proxy._gate.acquire(timeout=120)
                with httpx.Client(trust_env=False, timeout=120) as http:
                    upstream_response = http.request(
                        self.command, upstream + self.path, content=body, headers=headers
                    )
                if is_create:
                    with proxy._lock:
                        proxy.forwarded += 1
                    if hold == "response":
                        proxy._gate.acquire(timeout=120)
                content = upstream_response.content
                try:
                    self.send_response(upstream_response.status_code)
                    for key, value in upstream_response.headers.items():
                        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                except OSError:
                    self.close_connection = True  # the client is gone

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def release(self, n: int = 1000) -> None:
        for _ in range(n):
            self._gate.release()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


def _env(url: str, secret: str, config: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEDGEROW_")}
    env.update({"HEDGEROW_URL": url, "HEDGEROW_API_KEY": secret, "PYTHONPATH": str(SDK_DIR)})
    if config is not None:
        env["HEDGEROW_CONFIG"] = str(config)
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _live(tenant: object) -> list[tuple[str, str]]:
    return list(
        Sandbox.objects.filter(tenant=tenant)
        .exclude(state__in=GONE)
        .values_list("external_id", "state")
    )


def test_sigint_while_the_create_request_is_on_its_way_leaves_nothing(live, make_tenant):
    """The server has not yet seen the create when Ctrl-C arrives; it sees it after."""
    tenant, secret = make_tenant()
    proxy = _HoldingProxy(live.url, hold="request")
    proc = _python(
        "from hedgerow import Client\nClient().create_sandbox()\nprint('created')\n",
        _env(proxy.url, secret),
    )
    try:
        _until(lambda: proxy.arrived == 1, "the create to reach the proxy")
        proc.send_signal(signal.SIGINT)
        # The client registered the id before sending: its cleanup asks for the delete
        # while the create is still held (a 404 it keeps retrying) ...
        _until(lambda: bool(proxy.deletes) or proc.poll() is not None, "a cleanup delete")
        proxy.release()  # ... and the create reaches the server now.
        assert proc.wait(timeout=60) == -signal.SIGINT, proc.stderr.read() if proc.stderr else ""
        _until(lambda: proxy.forwarded == 1, "the held create to be answered")
        record = Sandbox.objects.get(tenant=tenant)
        assert proxy.deletes and proxy.deletes[0] == record.external_id
        assert record.heartbeat_timeout_s == 300  # the SDK's default
        assert _live(tenant) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    wait_all_deleted(tenant)


def test_sigint_in_a_sync_loop_while_a_create_answer_is_on_its_way_leaves_nothing(
    live, make_tenant
):
    """The issue's sync loop (9 of 30 runs leaked one): the server has made the third
    sandbox, its answer has not reached the client when Ctrl-C arrives."""
    tenant, secret = make_tenant()
    proxy = _HoldingProxy(live.url, hold="response")
    proc = _python(
        """
        from hedgerow import Client

        hr = Client()
        for _ in range(3):
            hr.create_sandbox(wait=False)
        print("created")
        """,
        _env(proxy.url, secret),
    )
    try:
        proxy.release(2)  # the first two answers get through; the third is held
        _until(lambda: proxy.forwarded == 3, "the third create to be made")
        assert Sandbox.objects.filter(tenant=tenant).count() == 3
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        assert code in (-signal.SIGINT, 1), proc.stderr.read() if proc.stderr else code
        assert "created" not in (proc.stdout.read() if proc.stdout else "")
        assert sorted(proxy.deletes) == sorted(
            Sandbox.objects.filter(tenant=tenant).values_list("external_id", flat=True)
        )
        assert _live(tenant) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    wait_all_deleted(tenant)


def test_sigint_during_an_async_gather_of_creates_deletes_them_all(live, make_tenant):
    tenant, secret = make_tenant()
    proxy = _HoldingProxy(live.url, hold="response")
    proc = _python(
        """
        import asyncio
        from hedgerow import AsyncClient

        async def main():
            async with AsyncClient() as hr:
                await asyncio.gather(*(hr.create_sandbox() for _ in range(8)))

        asyncio.run(main())
        print("created")
        """,
        _env(proxy.url, secret),
    )
    try:
        # Every create has been made by the server; none has an answer yet.
        _until(lambda: proxy.forwarded == 8, "all eight creates to be made")
        assert Sandbox.objects.filter(tenant=tenant).count() == 8
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        assert code in (-signal.SIGINT, 1), code
        assert "created" not in (proc.stdout.read() if proc.stdout else "")
        assert sorted(proxy.deletes) == sorted(
            Sandbox.objects.filter(tenant=tenant).values_list("external_id", flat=True)
        )
        assert _live(tenant) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    wait_all_deleted(tenant)


def test_cli_create_prints_ids_as_created_and_cleans_up_on_sigint(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    proxy = _HoldingProxy(live.url, hold="response")
    env = _env(proxy.url, secret, tmp_path / "config.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hedgerow.cli", "sandbox", "create", "--count", "3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _until(lambda: proxy.forwarded == 3, "three creates to be made")
        proxy.release(1)  # one answer gets through: its id is printed at once
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        assert Sandbox.objects.filter(tenant=tenant, external_id=first).exists()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert "interrupted" in (proc.stderr.read() if proc.stderr else "")
        assert Sandbox.objects.filter(tenant=tenant).count() == 3
        assert _live(tenant) == []
        # Sandboxes the CLI creates outlive it: no heartbeat timeout they could miss.
        assert set(
            Sandbox.objects.filter(tenant=tenant).values_list("heartbeat_timeout_s", flat=True)
        ) == {None}
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    wait_all_deleted(tenant)


def test_cli_create_keeps_what_it_created_when_not_interrupted(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    env = _env(live.url, secret, tmp_path / "config.json")
    done = subprocess.run(
        [sys.executable, "-m", "hedgerow.cli", "sandbox", "create", "--count", "2", "--no-wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert len(ids) == 2
    assert sorted(ids) == sorted(_id for _id, _ in _live(tenant))
    for sandbox_id in ids:
        httpx.delete(
            f"{live.url}/api/v1/sandboxes/{sandbox_id}",
            headers={"Authorization": f"Bearer {secret}"},
            trust_env=False,
        ).raise_for_status()
    wait_all_deleted(tenant)


def test_sdk_sandboxes_get_the_default_heartbeat_timeout_unless_told_otherwise(live, make_tenant):
    from hedgerow import Client

    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr:
        kept_alive = hr.create_sandbox(wait=False)
        unwatched = hr.create_sandbox(wait=False, heartbeat=False)
        explicit = hr.create_sandbox(wait=False, heartbeat_timeout_s=60)
        none = hr.create_sandbox(wait=False, heartbeat_timeout_s=0)
        timeouts = dict(
            Sandbox.objects.filter(tenant=tenant).values_list("external_id", "heartbeat_timeout_s")
        )
        assert timeouts == {
            kept_alive.id: 300,
            unwatched.id: None,
            explicit.id: 60,
            none.id: None,
        }
    assert _live(tenant) == []
    wait_all_deleted(tenant)


def test_a_script_that_exits_without_deleting_leaves_nothing_running(live, make_tenant):
    """Interpreter exit (atexit) deletes what the process created. The cleanup used a
    thread pool, which concurrent.futures refuses at interpreter shutdown ("cannot
    schedule new futures"): every sandbox stayed up until its heartbeat timeout."""
    tenant, secret = make_tenant()
    proc = _python(
        """
        from hedgerow import Client
        hr = Client()
        for _ in range(3):
            print(hr.create_sandbox().id, flush=True)
        """,
        _env(live.url, secret),
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "cannot schedule new futures" not in err and "Traceback" not in err, err
    created = out.split()
    assert len(created) == 3
    assert _live(tenant) == []
    assert set(Sandbox.objects.filter(tenant=tenant).values_list("external_id", flat=True)) == set(
        created
    )
    wait_all_deleted(tenant)


def test_sigint_drops_creates_never_sent_without_deleting_them(live, make_tenant):
    """The audit's 15 s exit: cleanup retried the DELETE (404 after 404) of every
    registered create, even those never sent. Two creates are on the wire (held by the
    proxy), six wait for a pooled connection: only the two sent are deleted, the six
    are dropped without a request, and none of them is sent after the signal."""
    tenant, secret = make_tenant()
    proxy = _HoldingProxy(live.url, hold="request")
    proc = _python(
        """
        import asyncio
        from hedgerow import AsyncClient

        async def main():
            async with AsyncClient(max_connections=2) as hr:
                await asyncio.gather(*(hr.create_sandbox() for _ in range(8)))

        asyncio.run(main())
        print("created")
        """,
        _env(proxy.url, secret),
    )
    try:
        _until(lambda: proxy.arrived == 2, "two creates to reach the proxy")
        proc.send_signal(signal.SIGINT)
        # The cleanup asks for the two sent ones while their creates are still held.
        _until(lambda: len(set(proxy.deletes)) >= 2 or proc.poll() is not None, "deletes")
        proxy.release()
        code = proc.wait(timeout=60)
        assert code in (-signal.SIGINT, 1), proc.stderr.read() if proc.stderr else code
        assert "created" not in (proc.stdout.read() if proc.stdout else "")
        assert proxy.arrived == 2  # nothing was sent after the signal
        made = set(Sandbox.objects.filter(tenant=tenant).values_list("external_id", flat=True))
        assert len(made) == 2
        assert set(proxy.deletes) == made  # no DELETE for the six never sent
        assert _live(tenant) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    wait_all_deleted(tenant)
