from __future__ import annotations

import hashlib
import http.client
import os
import stat
from pathlib import Path
from typing import Iterator, List
from urllib.parse import quote

from .conftest import TOKEN, Agent, Client


def url(path: str, endpoint: str = "/files", **params: str) -> str:
    query = "&".join(f"{k}={quote(v)}" for k, v in params.items())
    return f"{endpoint}?path={quote(path)}" + (f"&{query}" if query else "")


def test_it_uploads_with_content_length(client: Client, tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "file.txt"
    data = b"hello\n" * 1000
    status, body, _ = client.request("PUT", url(str(target), mode="0600"), data)
    assert status == 200
    digest = hashlib.sha256(data).hexdigest()
    assert body == {"path": str(target), "size": len(data), "sha256": digest}
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".hedgerow")]


def test_it_uploads_chunked(client: Client, tmp_path: Path) -> None:
    target = tmp_path / "chunked.bin"
    parts = [os.urandom(100000) for _ in range(5)]

    def gen() -> Iterator[bytes]:
        yield from parts

    client.conn.request(
        "PUT", url(str(target)), body=gen(), headers=client.headers(), encode_chunked=True
    )
    resp = client.conn.getresponse()
    resp.read()
    assert resp.status == 200
    assert target.read_bytes() == b"".join(parts)


def test_it_replaces_files_atomically_and_keeps_mode(client: Client, tmp_path: Path) -> None:
    target = tmp_path / "script.sh"
    target.write_text("old")
    target.chmod(0o755)
    inode = target.stat().st_ino
    status, _, _ = client.request("PUT", url(str(target)), b"new")
    assert status == 200
    assert target.read_text() == "new"
    assert target.stat().st_ino != inode  # renamed into place, not rewritten
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_it_rejects_too_large_uploads_leaving_no_file(client: Client, tmp_path: Path) -> None:
    target = tmp_path / "big"
    status, body, _ = client.request("PUT", url(str(target), max_bytes="10"), b"x" * 11)
    assert status == 413 and body["error"]["code"] == "too_large"
    assert not target.exists()

    def gen() -> Iterator[bytes]:
        for _ in range(4):
            yield b"y" * 8

    c = Client(client.port, TOKEN)
    c.conn.request("PUT", url(str(target), max_bytes="20"), body=gen(), headers=c.headers(),
                   encode_chunked=True)  # fmt: skip
    resp = c.conn.getresponse()
    assert resp.status == 413
    assert not target.exists() and os.listdir(tmp_path) == []
    c.close()


def test_it_downloads_a_file(client: Client, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    target = tmp_path / "blob"
    target.write_bytes(data)
    status, body, resp = client.request("GET", url(str(target)))
    assert status == 200
    assert resp.getheader("Content-Length") == str(len(data))
    assert body == data
    status, body, _ = client.request("GET", url(str(tmp_path / "empty-missing")))
    assert status == 404 and body["error"]["code"] == "not_found"
    target2 = tmp_path / "empty"
    target2.write_bytes(b"")
    status, body, _ = client.request("GET", url(str(target2)))
    assert status == 200 and body == b""


def test_it_lists_a_directory_including_broken_symlinks(client: Client, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "pipe")
    status, body, _ = client.request("GET", url(str(tmp_path), "/files/list"))
    assert status == 200
    by_name = {e["name"]: e for e in body["entries"]}
    assert by_name["f"]["type"] == "file" and by_name["f"]["size"] == 3
    assert by_name["d"]["type"] == "directory"
    assert by_name["broken"]["type"] == "symlink"
    assert by_name["broken"]["target"] == str(tmp_path / "nowhere")
    assert by_name["pipe"]["type"] == "other"
    assert by_name["f"]["path"] == str(tmp_path / "f")
    assert isinstance(by_name["f"]["modified"], float)


def test_it_stats_paths(client: Client, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("abcd")
    (tmp_path / "f").chmod(0o640)
    status, body, _ = client.request("GET", url(str(tmp_path / "f"), "/files/stat"))
    assert status == 200
    assert body["type"] == "file" and body["size"] == 4 and body["mode"] == "0640"
    status, body, _ = client.request("GET", url(str(tmp_path / "nope"), "/files/stat"))
    assert status == 404


def test_it_deletes_files_and_directories(client: Client, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "inner").write_text("y")
    status, body, _ = client.request("DELETE", url(str(tmp_path / "f")))
    assert status == 200 and body == {"path": str(tmp_path / "f"), "deleted": True}
    assert not (tmp_path / "f").exists()
    status, body, _ = client.request("DELETE", url(str(tmp_path / "d")))
    assert status == 400 and body["error"]["code"] == "directory_not_empty"
    status, body, _ = client.request("DELETE", url(str(tmp_path / "d"), recursive="1"))
    assert status == 200 and not (tmp_path / "d").exists()
    status, body, _ = client.request("DELETE", url(str(tmp_path / "d")))
    assert status == 404


def test_it_types_file_errors(client: Client, tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    cases = [
        ("GET", url("relative/path"), 400, "path_not_absolute"),
        ("GET", url(str(tmp_path)), 400, "is_a_directory"),
        ("PUT", url(str(tmp_path)), 400, "is_a_directory"),
        ("PUT", url(str(tmp_path / "plain" / "child")), 400, "not_a_directory"),
        ("GET", url(str(tmp_path / "plain"), "/files/list"), 400, "not_a_directory"),
        ("GET", url(str(tmp_path / "missing"), "/files/list"), 404, "not_found"),
    ]
    for method, path, want_status, code in cases:
        status, body, _ = client.request(method, path, b"data" if method == "PUT" else None)
        assert (status, body["error"]["code"]) == (want_status, code), (method, path)
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        status, body, _ = client.request("PUT", url(str(locked / "f")), b"x")
        assert status == 403 and body["error"]["code"] == "permission_denied"


def test_it_keeps_the_connection_usable_after_file_calls(agent: Agent, tmp_path: Path) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for i in range(20):
        conn.request("PUT", url(str(tmp_path / f"f{i}")), body=b"%d" % i, headers=headers)
        assert conn.getresponse().read()
        conn.request("GET", url(str(tmp_path / f"f{i}")), headers=headers)
        assert conn.getresponse().read() == b"%d" % i
    conn.close()


def test_it_transfers_only_regular_files_and_follows_symlinks_with_their_length(
    client: Client, tmp_path: Path
) -> None:
    # A symlink is followed; the length is the target's (not the link's own size).
    data = os.urandom(100_000)
    (tmp_path / "real.bin").write_bytes(data)
    (tmp_path / "link").symlink_to(tmp_path / "real.bin")
    status, body, resp = client.request("GET", url(str(tmp_path / "link")))
    assert status == 200 and body == data
    assert resp.getheader("Content-Length") == str(len(data))
    (tmp_path / "dirlink").symlink_to(tmp_path)
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    status, body, _ = client.request("GET", url(str(tmp_path / "dirlink")))
    assert (status, body["error"]["code"]) == (400, "is_a_directory")
    status, body, _ = client.request("GET", url(str(tmp_path / "broken")))
    assert (status, body["error"]["code"]) == (404, "not_found")
    # A FIFO (its open would block) or a device has no meaningful length: refused.
    os.mkfifo(tmp_path / "pipe")
    for target in (str(tmp_path / "pipe"), "/dev/null", "/dev/zero"):
        status, body, _ = client.request("GET", url(target))
        assert (status, body["error"]["code"]) == (400, "not_a_regular_file"), target
    for target in (str(tmp_path / "pipe"), "/dev/null"):
        status, body, _ = client.request("PUT", url(target), b"data")
        assert (status, body["error"]["code"]) == (400, "not_a_regular_file"), target
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hedgerow")]


def test_it_types_paths_past_the_kernels_limits(client: Client, tmp_path: Path) -> None:
    cases = [
        ("/" + "a" * 5000, "path_too_long"),
        ("/x" * 2000, "path_too_deep"),
        (str(tmp_path / ("n" * 300)), "name_too_long"),
    ]
    for path, code in cases:
        for method in ("GET", "PUT"):
            status, body, _ = client.request(method, url(path), b"x" if method == "PUT" else None)
            assert (status, body["error"]["code"]) == (400, code), (method, path[:40])
        status, body, _ = client.request("GET", url(path, "/files/list"))
        assert (status, body["error"]["code"]) == (400, code)
    assert not (tmp_path / "x").exists()


def test_it_pages_a_listing_in_name_order(client: Client, tmp_path: Path) -> None:
    names = sorted(f"f{i:05d}" for i in range(2500))
    for name in names:
        (tmp_path / name).write_bytes(b"")
    seen: List[str] = []
    after = ""
    pages = 0
    while True:
        params = {"limit": "1000"}
        if after:
            params["after"] = after
        status, body, _ = client.request("GET", url(str(tmp_path), "/files/list", **params))
        assert status == 200
        pages += 1
        seen.extend(e["name"] for e in body["entries"])
        if body["next"] is None:
            break
        after = body["next"]
    assert seen == names and pages == 3
    status, body, _ = client.request("GET", url(str(tmp_path), "/files/list", limit="0"))
    assert (status, body["error"]["field"]) == (400, "limit")
    status, body, _ = client.request("GET", url(str(tmp_path), "/files/list"))
    assert len(body["entries"]) == 2500 and body["next"] is None  # no limit: all, as before
