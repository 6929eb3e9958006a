"""Orchard files against the real stack (issue 14, findings 11–13): uploads up to
64 MiB round-trip byte for byte and bigger ones are a typed 413, downloads follow a
symlink and type an unreadable or non-regular file, listings keep their shape and page."""

from __future__ import annotations

import base64
import hashlib
import os

import httpx
import pytest

from apps.orchard.files import MAX_JSON_FILE_BYTES, MAX_UPLOAD_BODY
from apps.sandboxes.tests.test_files_live import MANY, _api, _fixtures, _ready, _sh

pytestmark = pytest.mark.timeout(300)


def test_orchard_files_up_to_64_mib_round_trip_and_bigger_is_a_typed_413(live, make_tenant):
    _, secret = make_tenant()
    http = _api(live, secret)
    sandbox_id = _ready(http)
    orchard = httpx.Client(
        base_url=live.url + "/orchard", headers={"X-API-Key": secret}, timeout=300, trust_env=False
    )
    url = f"/sandboxes/{sandbox_id}/files"
    for size in (8 * 1024 * 1024, MAX_JSON_FILE_BYTES):
        data = os.urandom(size)
        path = f"/workspace/up-{size}.bin"
        put = orchard.post(url, json={"path": path, "content": base64.b64encode(data).decode()})
        assert put.status_code == 200, put.text[:300]
        assert put.json() == {"success": True, "path": path, "size": size}
        assert _sh(http, sandbox_id, f"sha256sum {path}").split()[0] == (
            hashlib.sha256(data).hexdigest()
        )
        got = orchard.get(url, params={"path": path})
        assert got.status_code == 200
        assert base64.b64decode(got.json()["content"]) == data and got.json()["size"] == size
        del data, put, got

    # One byte over the file limit (the body still fits): 413 from the size check.
    over = base64.b64encode(b"\0" * (MAX_JSON_FILE_BYTES + 1)).decode()
    too_big = orchard.post(url, json={"path": "/workspace/over.bin", "content": over})
    assert too_big.status_code == 413, too_big.text[:300]
    assert too_big.json()["code"] == "too_large" and too_big.json()["detail"]
    # A body over the JSON limit: 413 before it is read.
    huge = orchard.post(
        url,
        content=b"{" + b" " * (MAX_UPLOAD_BODY + 1) + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert huge.status_code == 413 and huge.json()["code"] == "too_large"
    assert "over.bin" not in _sh(http, sandbox_id, "ls -a /workspace")

    # Downloads: a symlink's target, an unreadable file typed, a FIFO typed.
    _fixtures(http, sandbox_id)
    real = http.get(
        f"/sandboxes/{sandbox_id}/files", params={"path": "/workspace/real.bin"}
    ).content
    link = orchard.get(url, params={"path": "/workspace/link"}).json()
    assert base64.b64decode(link["content"]) == real and link["size"] == len(real)
    locked = orchard.get(url, params={"path": "/workspace/locked"})
    assert locked.status_code == 403 and locked.json()["code"] == "permission_denied"
    pipe = orchard.get(url, params={"path": "/workspace/pipe"})
    assert pipe.status_code == 400 and pipe.json()["code"] == "not_a_regular_file"

    # The Orchard listing keeps its shape, one page of up to 10000, with a cursor.
    first = orchard.get(url + "/list", params={"path": "/workspace/many"}).json()
    assert set(first) == {"path", "files", "next_cursor"}
    assert len(first["files"]) == 10000 and first["next_cursor"] == "10000"
    rest = orchard.get(
        url + "/list", params={"path": "/workspace/many", "cursor": first["next_cursor"]}
    ).json()
    assert len(rest["files"]) == MANY - 10000 and rest["next_cursor"] is None
    assert rest["files"][0]["name"] == "10001" and rest["files"][0]["type"] == "file"
