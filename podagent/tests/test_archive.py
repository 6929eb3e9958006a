"""Trees as one tar (``/files/archive``): what a per-file copy loses survives, the
walk's total is announced, and archives that try to leave their target are refused."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path
from urllib.parse import quote

from .conftest import Client


def url(path: str) -> str:
    return f"/files/archive?path={quote(path)}"


def test_it_sends_a_tree_with_modes_symlinks_and_empty_dirs(client: Client, tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "run").write_text("#!/bin/sh\n")
    (root / "bin" / "run").chmod(0o755)
    (root / "empty").mkdir()
    os.symlink("bin/run", root / "link")
    os.mkfifo(root / "fifo")  # left out: not a file, directory or link
    status, body, resp = client.request("GET", url(str(root)))
    assert status == 200, body
    assert resp.getheader("X-Tree-Bytes") == str(len("#!/bin/sh\n"))
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {".", "bin", "bin/run", "empty", "link"}
    assert members["bin/run"].mode == 0o755 and members["empty"].isdir()
    assert members["link"].issym() and members["link"].linkname == "bin/run"

    dest = tmp_path / "dest"
    status, result, _ = client.request("PUT", url(str(dest)), body)
    assert status == 200, result
    assert (result["files"], result["directories"], result["symlinks"]) == (1, 3, 1)
    assert stat.S_IMODE((dest / "bin" / "run").stat().st_mode) == 0o755
    assert os.readlink(dest / "link") == "bin/run" and (dest / "empty").is_dir()


def test_it_refuses_members_leaving_the_target(client: Client, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()

    def archive(*members: tarfile.TarInfo) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for member in members:
                data = io.BytesIO(b"x" * member.size) if member.isreg() else None
                tar.addfile(member, data)
        return buffer.getvalue()

    up = tarfile.TarInfo("../outside/up.txt")
    up.size = 1
    absolute = tarfile.TarInfo(str(outside / "abs.txt"))
    absolute.size = 1
    link = tarfile.TarInfo("door")
    link.type, link.linkname = tarfile.SYMTYPE, str(outside)
    through = tarfile.TarInfo("door/through.txt")
    through.size = 1
    hard = tarfile.TarInfo("hard")
    hard.type, hard.linkname = tarfile.LNKTYPE, "../outside/x"
    device = tarfile.TarInfo("dev")
    device.type = tarfile.CHRTYPE
    for body in (
        archive(up),
        archive(absolute),
        archive(link, through),
        archive(hard),
        archive(device),
        b"not a tar at all" * 64,
    ):
        status, result, _ = client.request("PUT", url(str(tmp_path / "t")), body)
        assert status == 400, result
        assert result["error"]["code"] == "archive_invalid"
    assert list(outside.iterdir()) == []


def test_it_refills_a_read_only_directory_and_drops_setuid(client: Client, tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        ro = tarfile.TarInfo("ro")
        ro.type, ro.mode = tarfile.DIRTYPE, 0o555
        tar.addfile(ro)
        inside = tarfile.TarInfo("ro/f")
        inside.size, inside.mode = 2, 0o4755
        tar.addfile(inside, io.BytesIO(b"hi"))
    dest = tmp_path / "d"
    for _ in range(2):  # the second time into the read-only directory the first made
        status, result, _ = client.request("PUT", url(str(dest)), buffer.getvalue())
        assert status == 200, result
    assert stat.S_IMODE((dest / "ro").stat().st_mode) == 0o555
    assert stat.S_IMODE((dest / "ro" / "f").stat().st_mode) == 0o755
    status, result, _ = client.request("GET", url(str(dest / "ro" / "f")))
    assert (status, result["error"]["code"]) == (400, "not_a_directory")
    status, result, _ = client.request("GET", url(str(tmp_path / "missing")))
    assert (status, result["error"]["code"]) == (404, "not_found")
