"""Uploads on the real stack (uvicorn, a real sandbox's agent): one with a Content-Length
is streamed by the upload fast path (apps/sandboxes/api/files_fastpath.py) and answers
what Django's path answers for the same bytes sent chunked; a refused upload is
answered when only its head was sent (the body never written, so the regular path —
which reads the body first — could not have answered); a client that goes away mid-body
leaves no file and no held slot."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings

from apps.billing.limits import in_flight, transfer_admit, transfer_release
from apps.sandboxes.tests.live_api import api_client, ready_sandbox, wait_all_deleted

pytestmark = pytest.mark.timeout(300)


def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _head_only(live, secret: str, sandbox_id: str, size: int) -> tuple[int, dict[str, Any]]:
    """Sends an upload's request head announcing ``size`` bytes and not one byte of
    its body; the answer (status, JSON), read within 30 s or the test fails."""
    netloc = urlsplit(live.url)
    with socket.create_connection((netloc.hostname, netloc.port), timeout=30) as sock:
        sock.sendall(
            (
                f"PUT /api/v1/sandboxes/{sandbox_id}/files?path=/workspace/head HTTP/1.1\r\n"
                f"Host: {netloc.netloc}\r\nAuthorization: Bearer {secret}\r\n"
                f"Content-Length: {size}\r\n\r\n"
            ).encode()
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length"))
        while len(rest) < length:
            rest += sock.recv(65536)
    return int(lines[0].split()[1]), json.loads(rest)


def test_uploads_stream_past_django_and_refusals_come_before_the_body(live, make_tenant):
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)  # the web process has now cached this key
    url = f"/sandboxes/{sandbox_id}/files"
    data = os.urandom(8 * 2**20 + 7)

    # The same bytes with a Content-Length (the fast path) and chunked (Django).
    fast = http.put(url, params={"path": "/workspace/fast.bin"}, content=data)
    regular = http.put(
        url, params={"path": "/workspace/slow.bin"}, content=iter([data[:1000], data[1000:]])
    )
    assert fast.status_code == regular.status_code == 200, (fast.text, regular.text)
    assert fast.json()["sha256"] == regular.json()["sha256"] == hashlib.sha256(data).hexdigest()
    assert fast.json()["size"] == regular.json()["size"] == len(data)
    assert fast.json().keys() == regular.json().keys()
    dropped = {"date", "x-request-id", "content-length"}
    assert {k: v for k, v in fast.headers.items() if k not in dropped} == {
        k: v for k, v in regular.headers.items() if k not in dropped
    }
    assert http.get(url, params={"path": "/workspace/fast.bin"}).content == data

    # A typed error from the agent mid-upload, in the regular envelope.
    refused = http.put(url, params={"path": "/dev/null"}, content=b"x" * 1000)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "not_a_regular_file"

    # Refused with only the head sent: over the size limit, then over the transfer slots.
    status, body = _head_only(live, secret, sandbox_id, settings.HEDGEROW_MAX_UPLOAD_BYTES + 1)
    assert (status, body["error"]["code"]) == (413, "too_large"), body
    limit = settings.HEDGEROW_FILE_TRANSFERS_PER_SANDBOX
    tenant_id = str(tenant.pk)
    held = [
        transfer_admit(tenant_id=tenant_id, sandbox_key=sandbox_id, nbytes=0) for _ in range(limit)
    ]
    try:
        status, body = _head_only(live, secret, sandbox_id, 200 * 2**20)
        assert status == 429, body
        assert (body["error"]["limit"], body["error"]["value"]) == (
            "file_transfers_per_sandbox",
            limit,
        )
    finally:
        for lease in held:
            transfer_release(tenant_id=tenant_id, sandbox_key=sandbox_id, lease=lease)

    # A client gone mid-body: no file appears, its slot is given back.
    before = http.get(url + "/list", params={"path": "/workspace"}).json()["entries"]
    netloc = urlsplit(live.url)
    with socket.create_connection((netloc.hostname, netloc.port), timeout=30) as sock:
        sock.sendall(
            (
                f"PUT /api/v1/sandboxes/{sandbox_id}/files?path=/workspace/gone HTTP/1.1\r\n"
                f"Host: {netloc.netloc}\r\nAuthorization: Bearer {secret}\r\n"
                f"Content-Length: {64 * 2**20}\r\n\r\n"
            ).encode()
            + b"y" * 2**20
        )
        _until(lambda: in_flight("file", tenant_id, sandbox_id) == 1, "upload not admitted")
    _until(lambda: in_flight("file", tenant_id, sandbox_id) == 0, "slot not given back")
    _until(
        lambda: http.get(url + "/list", params={"path": "/workspace"}).json()["entries"] == before,
        "a partial upload was left in /workspace",
    )
    assert http.get(url + "/stat", params={"path": "/workspace/gone"}).status_code == 404
    http.delete(f"/sandboxes/{sandbox_id}")
    wait_all_deleted(tenant)


def test_downloads_stream_past_django_and_give_their_slot_back(live, make_tenant):
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox_id = ready_sandbox(http)
    url = f"/sandboxes/{sandbox_id}/files"
    data = os.urandom(3 * 2**20 + 11)
    assert http.put(url, params={"path": "/workspace/d.bin"}, content=data).status_code == 200

    # The fast path (``path`` only) and Django (another parameter, ignored by the view)
    # answer the same bytes and headers.
    fast = http.get(url, params={"path": "/workspace/d.bin"})
    regular = http.get(url, params={"path": "/workspace/d.bin", "x": "1"})
    assert fast.status_code == regular.status_code == 200
    assert fast.content == regular.content == data
    dropped = {"date", "x-request-id"}
    assert {k: v for k, v in fast.headers.items() if k not in dropped} == {
        k: v for k, v in regular.headers.items() if k not in dropped
    }
    missing = http.get(url, params={"path": "/workspace/none"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    empty = http.put(url, params={"path": "/workspace/empty"}, content=b"")
    assert empty.status_code == 200
    got = http.get(url, params={"path": "/workspace/empty"})
    assert (got.status_code, got.content, got.headers["content-length"]) == (200, b"", "0")

    # Over the transfer slots: a typed 429 once the agent has opened the file.
    limit, tenant_id = settings.HEDGEROW_FILE_TRANSFERS_PER_SANDBOX, str(tenant.pk)
    # A download gives its slot back after its last byte went out, so the client can
    # hold the whole body a moment before the server releases it: wait for that state
    # (it failed a fresh-clone CI once, 9 of 8 slots taken), then fill the slots.
    _until(lambda: in_flight("file", tenant_id, sandbox_id) == 0, "downloads kept their slot")
    held = [
        transfer_admit(tenant_id=tenant_id, sandbox_key=sandbox_id, nbytes=0) for _ in range(limit)
    ]
    try:
        refused = http.get(url, params={"path": "/workspace/d.bin"})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["limit"] == "file_transfers_per_sandbox"
    finally:
        for lease in held:
            transfer_release(tenant_id=tenant_id, sandbox_key=sandbox_id, lease=lease)

    # A client that reads a little and goes away gives its slot back.
    big = 64 * 2**20
    made = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": f"head -c {big} /dev/zero > /workspace/big.bin"},
    )
    assert made.json()["exit_code"] == 0, made.text
    # Both paths take the slot before the response's head goes out and hold it until
    # the last byte (or the client leaving): Django's too, which a download takes when
    # this process's key cache has lapsed (5 s) — here forced by an extra parameter.
    for params in ({"path": "/workspace/big.bin"}, {"path": "/workspace/big.bin", "x": "1"}):
        with http.stream("GET", url, params=params) as response:
            assert response.headers["content-length"] == str(big)
            assert len(next(response.iter_raw(65536))) > 0
            assert in_flight("file", tenant_id, sandbox_id) == 1, params
        _until(lambda: in_flight("file", tenant_id, sandbox_id) == 0, "slot not given back")
    http.delete(f"/sandboxes/{sandbox_id}")
    wait_all_deleted(tenant)
