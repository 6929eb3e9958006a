"""File transfer and bad input against the real stack (issue 14, findings 11–13; the
Orchard side is apps/orchard/tests/test_files_live.py):
uploads round-trip byte for byte, a download's length always matches its body (a
symlink is followed inside the sandbox; an unreadable or non-regular file is a typed
4xx before any header), bad paths are typed 400s, listings are paged."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

# This worktree's SDK (an editable install elsewhere must not stand in for it).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "sdk"))

MANY = 12_000  # past the REST default page (1000) and Orchard's (10000)


def _api(live, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=120,
        trust_env=False,
    )


def _ready(http: httpx.Client) -> str:
    created = http.post("/sandboxes", json={"image": "host", "memory": "512Mi"})
    assert created.status_code in (200, 201), created.text
    sandbox_id = str(created.json()["id"])
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 90}).status_code == 200
    return sandbox_id


def _sh(http: httpx.Client, sandbox_id: str, command: str) -> str:
    result = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": command}).json()
    assert result["exit_code"] == 0, result
    return str(result["stdout"])


def _error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == code and isinstance(error["message"], str), error


def _fixtures(http: httpx.Client, sandbox_id: str) -> None:
    """A symlink to a file, to a directory, a broken one, an unreadable file, a FIFO,
    and MANY files in one directory."""
    _sh(
        http,
        sandbox_id,
        "cd /workspace && head -c 300000 /dev/urandom > real.bin && ln -s real.bin link "
        "&& ln -s /workspace dirlink && ln -s nowhere broken "
        "&& echo secret > locked && chmod 000 locked && mkfifo pipe "
        f"&& mkdir many && cd many && seq -w 1 {MANY} | xargs touch",
    )


def test_rest_files_round_trip_and_every_bad_input_is_typed(live, make_tenant):
    _, secret = make_tenant()
    http = _api(live, secret)
    sandbox_id = _ready(http)
    url = f"/sandboxes/{sandbox_id}/files"

    # An 8 MiB upload (streamed) comes back byte for byte.
    data = os.urandom(8 * 1024 * 1024)
    put = http.put(url, params={"path": "/workspace/big.bin"}, content=data)
    assert put.status_code == 200, put.text
    assert put.json()["sha256"] == hashlib.sha256(data).hexdigest()
    got = http.get(url, params={"path": "/workspace/big.bin"})
    assert got.content == data and got.headers["content-length"] == str(len(data))

    _fixtures(http, sandbox_id)
    real = http.get(url, params={"path": "/workspace/real.bin"}).content
    assert len(real) == 300000

    # A symlink is followed inside the sandbox: the target's bytes and length.
    link = http.get(url, params={"path": "/workspace/link"})
    assert link.status_code == 200 and link.content == real
    assert link.headers["content-length"] == str(len(real))
    _error(http.get(url, params={"path": "/workspace/dirlink"}), 400, "is_a_directory")
    _error(http.get(url, params={"path": "/workspace/broken"}), 404, "not_found")
    # Unreadable, a FIFO, a device: typed before any header (no 200 with a broken body).
    _error(http.get(url, params={"path": "/workspace/locked"}), 403, "permission_denied")
    _error(http.get(url, params={"path": "/workspace/pipe"}), 400, "not_a_regular_file")
    _error(http.get(url, params={"path": "/dev/zero"}), 400, "not_a_regular_file")
    _error(http.put(url, params={"path": "/dev/null"}, content=b"x"), 400, "not_a_regular_file")
    assert _sh(http, sandbox_id, "test -c /dev/null && echo chr") == "chr\n"

    # Paths past the kernel's limits.
    for path, code in [
        ("/" + "a" * 5000, "path_too_long"),
        ("/d" * 2000, "path_too_deep"),
        ("/workspace/" + "n" * 300, "name_too_long"),
    ]:
        _error(http.put(url, params={"path": path}, content=b"x"), 400, code)
        _error(http.get(url, params={"path": path}), 400, code)
        _error(http.get(url + "/list", params={"path": path}), 400, code)

    # Exec bodies the fast path sees first (under its 64 KiB): typed by DRF, not a 500.
    exec_url = f"/sandboxes/{sandbox_id}/exec"
    deep = http.post(
        exec_url,
        content='{"command": ' + "[" * 20000 + "]" * 20000 + "}",
        headers={"Content-Type": "application/json"},
    )
    _error(deep, 400, "json_too_deep")
    lone = http.post(
        exec_url,
        content='{"command": "echo \\ud800", "env": {"K\\udc00": "v"}}',
        headers={"Content-Type": "application/json"},
    )
    _error(lone, 400, "invalid_text")

    # A listing of MANY files is paged: default 1000, cursors cover each name once.
    listing = http.get(url + "/list", params={"path": "/workspace/many"}).json()
    assert len(listing["entries"]) == 1000 and listing["next_cursor"]
    names: list[str] = []
    cursor = None
    while True:
        params = {"path": "/workspace/many", "limit": "5000"}
        if cursor:
            params["cursor"] = cursor
        page = http.get(url + "/list", params=params)
        assert page.status_code == 200, page.text
        names.extend(e["name"] for e in page.json()["entries"])
        cursor = page.json()["next_cursor"]
        if not cursor:
            break
    assert names == sorted(f"{i:05d}" for i in range(1, MANY + 1))
    limit = http.get(url + "/list", params={"path": "/workspace/many", "limit": "10001"})
    assert limit.status_code == 400 and limit.json()["error"]["field"] == "limit"

    # The SDK follows the pages.
    import hedgerow

    with hedgerow.Client(live.url, secret) as hr:
        sandbox = hr.get(sandbox_id)
        entries = sandbox.list_files("/workspace/many", page_size=4000)
        assert [e["name"] for e in entries] == names
        first = sandbox.list_files_page("/workspace/many", limit=10)
        assert len(first["entries"]) == 10 and first["next_cursor"] == "00010"
