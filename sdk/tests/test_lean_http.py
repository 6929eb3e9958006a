"""The SDK's lean keep-alive path (hedgerow/_lean.py) against a real HTTP/1.1 server on
a local socket: what it sends, keep-alive reuse, chunked and closing answers, a
connection the server closed while idle, errors and retries worded as httpx's."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import hedgerow
import pytest
from hedgerow import AsyncClient, Client


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict[str, Any]] = []
        self.connections = 0
        self.closed = threading.Event()
        self.release = threading.Event()
        self.busy_left = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        self.server.seen.append(
            {"method": self.command, "path": self.path, "headers": dict(self.headers), "raw": raw}
        )
        name = self.path.split("?")[0].rsplit("/", 1)[-1]
        body = json.dumps({"path": self.path, "echo": json.loads(raw) if raw else None}).encode()
        if name == "busy" and self.server.busy_left > 0:
            self.server.busy_left -= 1
            self._send(503, b'{"error": {"code": "unavailable", "message": "busy"}}', retry=True)
        elif name == "chunked":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (body[:5], body[5:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        elif name == "close":
            self.close_connection = True
            self._send(200, body, close=True)
        elif name == "hangup":  # answers, then closes without saying so
            self._send(200, body)
            self.close_connection = True
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.server.closed.set()
        elif name == "slow":
            self.server.release.wait(30)
            self._send(200, body)
        elif name == "missing":
            self._send(404, b'{"error": {"code": "sandbox_not_found", "message": "no such"}}')
        else:
            self._send(200, body)

    def _send(self, status: int, body: bytes, retry: bool = False, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if retry:
            self.send_header("Retry-After", "0")
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def _client(url: str, **kwargs: Any) -> Client:
    return Client(url, "hr_secret", cleanup=False, handle_signals=False, **kwargs)


def test_plain_json_calls_share_one_kept_alive_connection_and_send_what_httpx_would(server):
    with _client(server.url) as hr:
        first = hr.request("POST", "/sandboxes/sb-1/exec", json={"command": "echo é", "n": 1})
        second = hr.request("GET", "/sandboxes/sb-1")
        third = hr.request("POST", "/sandboxes/sb-1/heartbeat")
        assert first.json() == {
            "path": "/api/v1/sandboxes/sb-1/exec",
            "echo": {"command": "echo é", "n": 1},
        }
        assert second.json()["path"] == "/api/v1/sandboxes/sb-1"
        assert third.status_code == 200 and third.headers["content-type"] == "application/json"
        assert server.connections == 1  # one keep-alive connection for all three
        # the body as httpx encodes json= (compact, UTF-8) and the client's headers
        via_httpx = hr._http.build_request("POST", "/x", json={"command": "echo é", "n": 1})
        assert server.seen[0]["raw"] == via_httpx.content
        headers = server.seen[0]["headers"]
        assert headers["Authorization"] == "Bearer hr_secret"
        assert headers["User-Agent"] == f"hedgerow-python/{hedgerow.__version__}"
        assert headers["Content-Type"] == "application/json"
        assert headers["Host"] == server.url.split("//")[1]
        assert server.seen[2]["headers"]["Content-Length"] == "0"
        assert "Content-Length" not in server.seen[1]["headers"]


def test_calls_with_params_headers_or_odd_paths_go_through_httpx(server):
    with _client(server.url) as hr:
        hr.request("GET", "/sandboxes", params={"label": "a b"})
        hr.request("POST", "/sandboxes", json={}, headers={"Idempotency-Key": "k"})
        hr.request("GET", "/sandboxes/a b")
        assert [s["path"] for s in server.seen] == [
            "/api/v1/sandboxes?label=a+b",
            "/api/v1/sandboxes",
            "/api/v1/sandboxes/a%20b",
        ]
        assert server.seen[1]["headers"]["Idempotency-Key"] == "k"
        assert len(hr._lean._idle) == 0  # none of them used the lean connections


def test_chunked_and_closing_answers_are_read_whole(server):
    with _client(server.url) as hr:
        assert hr.request("GET", "/chunked").json()["path"] == "/api/v1/chunked"
        assert hr.request("GET", "/chunked").json()["path"] == "/api/v1/chunked"
        assert server.connections == 1  # a chunked answer keeps the connection
        assert hr.request("GET", "/close").json()["path"] == "/api/v1/close"
        assert hr._lean._idle == []  # "Connection: close" is honoured
        assert hr.request("GET", "/x").json()["path"] == "/api/v1/x"
        assert server.connections == 2


def test_a_connection_the_server_closed_while_idle_is_not_reused(server):
    with _client(server.url, max_retries=0) as hr:
        assert hr.request("GET", "/hangup").status_code == 200
        assert server.closed.wait(10)
        # no retry allowed: the call must not be sent into the closed connection
        assert hr.request("POST", "/after", json={"a": 1}).json()["echo"] == {"a": 1}
        assert server.connections == 2
        assert len(server.seen) == 2


def _in_child(url: str, hr: Client, out: Any) -> None:
    out.put(hr.request("GET", "/from-child").json()["path"])


def test_a_forked_child_opens_its_own_connection(server):
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    with _client(server.url) as hr:
        assert hr.request("GET", "/parent").status_code == 200
        out = fork.Queue()
        child = fork.Process(target=_in_child, args=(server.url, hr, out))
        child.start()
        assert out.get(timeout=30) == "/api/v1/from-child"
        child.join(30)
        assert child.exitcode == 0
        # the parent's connection was neither used nor closed by the child
        assert hr.request("GET", "/parent-again").status_code == 200
        assert server.connections == 2
        assert [s["path"] for s in server.seen] == [
            "/api/v1/parent",
            "/api/v1/from-child",
            "/api/v1/parent-again",
        ]


def test_errors_retries_and_timeouts_behave_as_on_httpx(server, monkeypatch):
    monkeypatch.setattr("hedgerow.client.time.sleep", lambda s: None)
    with _client(server.url, max_retries=2) as hr:
        with pytest.raises(hedgerow.NotFound) as raised:
            hr.request("GET", "/missing")
        assert raised.value.code == "sandbox_not_found" and raised.value.message == "no such"
        server.busy_left = 2
        assert hr.request("GET", "/busy").status_code == 200
        assert [s["path"] for s in server.seen[1:]] == ["/api/v1/busy"] * 3
    with _client(server.url, max_retries=0, timeout=0.2) as hr:
        with pytest.raises(hedgerow.HedgerowConnectionError) as timed_out:
            hr.request("GET", "/slow")
        assert timed_out.value.code == "connection_error"
        server.release.set()
    # a refused connection: the same one-line error as through httpx
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        messages = []
        for lean in (True, False):
            with _client(url, max_retries=0) as hr:
                if not lean:
                    hr._lean_for = None  # force httpx
                with pytest.raises(hedgerow.HedgerowConnectionError) as refused:
                    hr.request("GET", "/sandboxes/sb-1")
                messages.append(str(refused.value))
        assert messages[0] == messages[1] and "Connection refused" in messages[0]


def test_the_async_client_takes_the_same_path_on_each_event_loop(server):
    client = AsyncClient(server.url, "hr_secret", cleanup=False, handle_signals=False)

    async def calls() -> list[Any]:
        got = [
            (await client.request("POST", "/exec", json={"command": "echo"})).json(),
            (await client.request("GET", "/chunked")).json(),
        ]
        with pytest.raises(hedgerow.NotFound):
            await client.request("GET", "/missing")
        got.append((await client.request("GET", "/x")).json())
        return got

    first = asyncio.run(calls())
    assert [g["path"] for g in first] == ["/api/v1/exec", "/api/v1/chunked", "/api/v1/x"]
    assert first[0]["echo"] == {"command": "echo"}
    assert server.connections == 1
    # a later event loop cannot use the first loop's connection: it opens its own
    second = asyncio.run(calls())
    assert [g["path"] for g in second] == [g["path"] for g in first]
    assert server.connections == 2

    async def gather() -> None:
        results = await asyncio.gather(
            *[client.request("POST", "/exec", json={"i": i}) for i in range(5)]
        )
        assert sorted(r.json()["echo"]["i"] for r in results) == list(range(5))
        await client.aclose()

    asyncio.run(gather())
    assert client._lean._idle == []

    async def too_slow() -> None:
        quick = AsyncClient(server.url, "k", cleanup=False, handle_signals=False, timeout=0.2)
        quick.max_retries = 0
        with pytest.raises(hedgerow.HedgerowConnectionError) as timed_out:
            await quick.request("GET", "/slow")
        assert "ReadTimeout" in str(timed_out.value) or "timed out" in str(timed_out.value)
        await quick.aclose()

    asyncio.run(too_slow())
    server.release.set()
