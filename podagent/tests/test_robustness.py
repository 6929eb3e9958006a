from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from .conftest import TOKEN, Agent, Client, new_op_id, out


def raw(agent: Agent, data: bytes, read: bool = True) -> bytes:
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=10)
    try:
        with contextlib.suppress(OSError):  # the agent may hang up mid-garbage
            sock.sendall(data)
        if not read:
            return b""
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        sock.close()


def test_it_rejects_malformed_json(client: Client) -> None:
    status, body, _ = client.request("POST", "/exec", b"{not json")
    assert status == 400 and body["error"]["code"] == "bad_request"
    status, body, _ = client.request("POST", "/exec", b"[1, 2]")
    assert status == 400


def test_it_answers_404_and_405_with_json(client: Client) -> None:
    status, body, _ = client.request("GET", "/nope")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body, resp = client.request("GET", "/exec")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert resp.getheader("Allow") == "POST"
    status, body, _ = client.request("PATCH", "/files?path=/x", b"")
    assert status == 405
    status, body, _ = client.request("GET", "/operations/a/b/c")
    assert status == 404


def test_it_limits_the_json_body(agent: Agent) -> None:
    # Refused from the declared length, before the body is read.
    reply = raw(
        agent,
        b"POST /exec HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
        + b"\r\nContent-Length: 9437184\r\n\r\n{\"operation_id\": ",
    )  # fmt: skip
    assert reply.startswith(b"HTTP/1.1 413")
    assert b'"too_large"' in reply
    # Chunked bodies have no declared length: the limit applies while reading.
    c = agent.client()
    big = json.dumps({"operation_id": new_op_id(), "command": "x" * (9 * 1024 * 1024)})
    chunks = [big[i : i + 65536].encode() for i in range(0, len(big), 65536)]
    with contextlib.suppress(OSError):
        c.conn.request("POST", "/exec", body=iter(chunks), headers=c.headers(),
                       encode_chunked=True)  # fmt: skip
    resp = c.conn.getresponse()
    assert resp.status == 413
    c.close()
    assert agent.alive()


def test_it_echoes_the_request_id_and_logs_it(agent: Agent, client: Client) -> None:
    _, _, resp = client.request("GET", "/health", headers={"X-Request-Id": "req-abc-123"})
    assert resp.getheader("X-Request-Id") == "req-abc-123"
    deadline = time.monotonic() + 10
    while True:  # the log line is written just after the response
        lines = [json.loads(line) for line in Path(agent.log_file).read_text().splitlines()]
        if any(ln.get("request_id") == "req-abc-123" and ln["path"] == "/health" for ln in lines):
            break
        assert time.monotonic() < deadline, lines[-5:]
        time.sleep(0.05)


def test_it_survives_garbage_and_floods(agent: Agent) -> None:
    garbage = [
        b"\x00\x01\x02garbage\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /health HTTP/1.1\r\n" + b"X-Long: " + b"a" * 100000 + b"\r\n\r\n",
        b"POST /exec HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /exec HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
        + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /exec HTTP/1.1\r\nContent-Length: 100\r\n\r\nshort",
        b"GET /health HTTP/1.1\r\n" + b"H: v\r\n" * 500 + b"\r\n",
        os.urandom(200000),
    ]  # fmt: skip
    for data in garbage:
        reply = raw(agent, data)
        assert not reply or reply.startswith(b"HTTP/1.")
    threads = [
        threading.Thread(target=raw, args=(agent, os.urandom(50000), False)) for _ in range(50)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert agent.alive()


def test_it_closes_the_connection_when_it_did_not_read_the_body(agent: Agent) -> None:
    # An unauthorised upload is refused before its body is read; the agent must
    # not parse the leftover body as the next request.
    reply = raw(
        agent,
        b"PUT /files?path=/tmp/x HTTP/1.1\r\nContent-Length: 40\r\n\r\n"
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n12345",
    )
    assert reply.startswith(b"HTTP/1.1 401")
    assert reply.count(b"HTTP/1.1") == 1
    assert b"Connection: close" in reply


def test_it_serves_many_requests_on_one_connection(client: Client) -> None:
    for i in range(200):
        assert out(client.exec(["echo", str(i)])) == f"{i}\n"


def test_it_parses_request_headers_as_http_server_would(agent: Agent, tmp_path: Path) -> None:
    # Header names in any case, padded values, obs-folded continuation lines.
    body = json.dumps({"operation_id": new_op_id(), "command": ["echo", "ok"]}).encode()
    reply = raw(
        agent,
        b"POST /exec HTTP/1.1\r\nauthorization:   Bearer " + TOKEN.encode() + b"  \r\n"
        b"x-REQUEST-id: rid-1\r\nX-Folded: a\r\n  b\r\ncontent-length: %d\r\n"
        b"Connection: close\r\n\r\n" % len(body) + body,
    )  # fmt: skip
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply
    assert b"X-Request-Id: rid-1" in head
    assert b"Connection: close" in head
    assert json.loads(payload)["stdout"]["head"] == "ok\n"

    # Expect: 100-continue gets its interim answer before the body is read.
    target = tmp_path / "continued.txt"
    reply = raw(
        agent,
        b"PUT /files?path=%s HTTP/1.1\r\nAuthorization: Bearer %s\r\nContent-Length: 5\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\nhello"
        % (str(target).encode(), TOKEN.encode()),
    )  # fmt: skip
    assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200"), reply
    assert target.read_bytes() == b"hello"

    # The limits http.client applies: 431 for a line too long or too many headers.
    too_long = b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n"
    too_many = b"GET /health HTTP/1.1\r\n" + b"H: v\r\n" * 101 + b"\r\n"
    for data in (too_long, too_many):
        reply = raw(agent, data)
        assert reply.startswith(b"HTTP/1.1 431"), reply[:80]
        assert b"Connection: close" in reply

    # HTTP/1.0 (no keep-alive) and Connection: close end the connection after one
    # answer: the second, pipelined request is never answered.
    for first in (
        b"GET /health HTTP/1.0\r\n\r\n",
        b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
    ):
        reply = raw(agent, first + b"GET /health HTTP/1.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert reply.count(b"HTTP/1.1 ") == 1

    # A bad version is a 400, HTTP/2 a 505.
    assert raw(agent, b"GET /health HTTP/1.x\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert raw(agent, b"GET /health HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 505")
