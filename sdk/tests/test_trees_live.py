"""Directory trees as one streamed archive both ways (issue 26 defect 3): one request
per tree, modes, symlinks and empty directories kept, progress over the whole
transfer, cp into an existing directory, and archives that try to leave their
target refused."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest
from hedgerow import AsyncClient, Client, HedgerowError, NotFound

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


def make_tree(root: Path) -> int:
    """A tree with what per-file copies lose; returns its files' total bytes."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "bin" / "run.sh").chmod(0o755)
    (root / "data").mkdir()
    for i in range(40):
        (root / "data" / f"f{i:02}.txt").write_bytes(os.urandom(1000 + i))
    (root / "empty" / "deeper").mkdir(parents=True)
    (root / "ro").mkdir()
    (root / "ro" / "kept.txt").write_text("read-only parent")
    (root / "ro").chmod(0o555)
    os.symlink("bin/run.sh", root / "run")
    os.symlink("/etc/hostname", root / "abs-link")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def assert_same_tree(a: Path, b: Path) -> None:
    def snapshot(root: Path) -> dict[str, tuple[str, int, str]]:
        seen = {}
        for path in sorted(root.rglob("*")):
            st = path.lstat()
            kind = "l" if path.is_symlink() else "d" if path.is_dir() else "f"
            payload = (
                os.readlink(path) if kind == "l" else path.read_bytes().hex() if kind == "f" else ""
            )
            seen[path.relative_to(root).as_posix()] = (kind, stat.S_IMODE(st.st_mode), payload)
        return seen

    assert snapshot(a) == snapshot(b)


def test_it_moves_a_tree_as_one_archive_each_way_keeping_what_files_lose(
    live, make_tenant, tmp_path
):
    tenant, secret = make_tenant()
    local = tmp_path / "proj"
    total = make_tree(local)
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        requests: list[tuple[str, str]] = []
        hr._http.event_hooks["request"].append(
            lambda r: requests.append((r.method, r.url.path.split(f"{sandbox.id}/")[-1]))
        )
        sent: list[int] = []
        totals: list[int] = []
        assert (
            sandbox.upload(local, "/workspace/proj", progress=sent.append, on_total=totals.append)
            == total
        )
        assert requests == [("PUT", "files/archive")]
        assert (totals, sum(sent)) == ([total], total)

        check = sandbox.exec(
            "cd /workspace/proj && stat -c '%a %F %n' bin/run.sh ro empty/deeper data/f00.txt"
            " && readlink run abs-link && ./run"
        )
        assert check.exit_code == 0, check.stderr
        assert check.stdout.splitlines() == [
            "755 regular file bin/run.sh",
            "555 directory ro",
            "755 directory empty/deeper",
            "644 regular file data/f00.txt",
            "bin/run.sh",
            "/etc/hostname",
            "ran",
        ]

        requests.clear()
        got: list[int] = []
        totals.clear()
        back = tmp_path / "back"
        assert (
            sandbox.download("/workspace/proj", back, progress=got.append, on_total=totals.append)
            == total
        )
        assert requests == [("GET", "files/stat"), ("GET", "files/archive")]
        assert (totals, sum(got)) == ([total], total)
        assert_same_tree(local, back)

        # Into an existing tree: files there are replaced, others kept.
        (local / "data" / "f00.txt").write_text("changed")
        sandbox.write_file("/workspace/proj/extra.txt", "stays")
        sandbox.upload(local, "/workspace/proj")
        assert sandbox.read_file("/workspace/proj/data/f00.txt") == b"changed"
        assert sandbox.read_file("/workspace/proj/extra.txt") == b"stays"


def test_it_moves_trees_the_same_way_in_the_async_client(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    local = tmp_path / "proj"
    total = make_tree(local)

    async def main() -> None:
        async with AsyncClient(live.url, secret) as hr:
            async with await hr.create_sandbox() as sandbox:
                sent: list[int] = []
                assert await sandbox.upload(local, "/workspace/p", progress=sent.append) == total
                assert sum(sent) == total
                back = tmp_path / "back"
                assert await sandbox.download("/workspace/p", back) == total
                assert_same_tree(local, back)

    asyncio.run(main())


def test_it_refuses_archives_that_leave_their_target(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        http = httpx.Client(
            base_url=f"{live.url}/api/v1/sandboxes/{sandbox.id}",
            headers={"Authorization": f"Bearer {secret}"},
            trust_env=False,
        )

        def archive(*members: tarfile.TarInfo) -> bytes:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as tar:
                for member in members:
                    tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isreg() else None)
            return buffer.getvalue()

        escape = tarfile.TarInfo("../escaped.txt")
        escape.size = 1
        link = tarfile.TarInfo("out")
        link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
        through = tarfile.TarInfo("out/through.txt")
        through.size = 1
        for body in (archive(escape), archive(link, through), b"not a tar" * 100):
            response = http.put("/files/archive", params={"path": "/workspace/t"}, content=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "archive_invalid"
        _, outsider = make_tenant()
        foreign = httpx.Client(
            base_url=f"{live.url}/api/v1/sandboxes/{sandbox.id}",
            headers={"Authorization": f"Bearer {outsider}"},
            trust_env=False,
        )
        tar = archive(tarfile.TarInfo("d"))
        assert foreign.get("/files/archive", params={"path": "/workspace"}).status_code == 404
        put = foreign.put("/files/archive", params={"path": "/workspace/f"}, content=tar)
        assert put.status_code == 404
        assert sandbox.exec("test -e /workspace/f").exit_code == 1
        leaked = sandbox.exec("ls /workspace/escaped.txt /tmp/through.txt")
        assert leaked.exit_code != 0
        with pytest.raises(NotFound):
            sandbox.download("/workspace/nowhere", "/tmp/x")
    with Client(live.url, secret) as hr:
        with pytest.raises(HedgerowError) as local_missing:
            hr.get(sandbox.id).upload("./no/such/dir", "/workspace/x")
    assert local_missing.value.code == "local_path_missing"
    assert "no/such/dir does not exist" in str(local_missing.value)


def test_it_copies_into_an_existing_directory_both_ways_from_the_cli(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    local = tmp_path / "proj"
    make_tree(local)
    env = {**os.environ, "HEDGEROW_URL": live.url, "HEDGEROW_API_KEY": secret}
    env["PYTHONPATH"] = str(SDK_DIR)
    env["HEDGEROW_CONFIG"] = str(tmp_path / "none.json")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        sandbox.exec("mkdir -p /workspace/dest")
        up = cli("sandbox", "cp", str(local), f"{sandbox.id}:/workspace/dest")
        assert up.returncode == 0, up.stderr
        assert f"→ {sandbox.id}:/workspace/dest/proj" in up.stdout
        assert sandbox.stat("/workspace/dest/proj/bin/run.sh")["mode"] == "0755"
        there = tmp_path / "there"
        there.mkdir()
        down = cli("sandbox", "cp", f"{sandbox.id}:/workspace/dest/proj", str(there))
        assert down.returncode == 0, down.stderr
        assert_same_tree(local, there / "proj")
        missing = cli("sandbox", "cp", str(tmp_path / "nope"), f"{sandbox.id}:/workspace/x")
        assert missing.returncode == 1
        assert missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
