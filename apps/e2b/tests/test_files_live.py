"""envd's filesystem through the real e2b SDK."""

from __future__ import annotations

import io
import os

import pytest
from e2b import FileNotFoundException, FileType, InvalidArgumentException, Sandbox

from apps.e2b.tests.live import opts, wait_all_deleted
from apps.sandboxes.models import Operation

pytestmark = pytest.mark.timeout(240)


def test_it_writes_reads_lists_makes_renames_and_removes(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    files = sbx.files

    info = files.write("/workspace/hello.txt", "héllo\n")
    assert (info.path, info.name, info.type) == ("/workspace/hello.txt", "hello.txt", FileType.FILE)
    assert files.read("/workspace/hello.txt") == "héllo\n"

    every_byte = bytes(range(256)) * 64
    files.write("/workspace/bin/all.bin", every_byte)  # parents are created
    assert bytes(files.read("/workspace/bin/all.bin", format="bytes")) == every_byte
    # a streamed (file-like) upload goes as an octet-stream body
    files.write("/workspace/bin/streamed.bin", io.BytesIO(every_byte[::-1]))
    assert bytes(files.read("/workspace/bin/streamed.bin", format="bytes")) == every_byte[::-1]
    # several files in one multipart body
    written = files.write_files(
        [{"path": "/workspace/m/a.txt", "data": "a"}, {"path": "/workspace/m/b.txt", "data": b"b"}]
    )
    assert [w.path for w in written] == ["/workspace/m/a.txt", "/workspace/m/b.txt"]
    assert files.read("/workspace/m/b.txt") == "b"

    listed = {e.name: e for e in files.list("/workspace")}
    assert {"hello.txt", "bin", "m"} <= set(listed)
    assert listed["bin"].type == FileType.DIR and listed["hello.txt"].type == FileType.FILE
    assert listed["hello.txt"].size == len("héllo\n".encode())
    deep = {e.path for e in files.list("/workspace", depth=2)}
    assert "/workspace/bin/all.bin" in deep

    assert files.make_dir("/workspace/new/deeper") is True
    assert files.make_dir("/workspace/new/deeper") is False  # already there
    assert files.exists("/workspace/new/deeper") is True
    assert files.get_info("/workspace/new/deeper").type == FileType.DIR

    moved = files.rename("/workspace/hello.txt", "/workspace/new/hi.txt")
    assert moved.path == "/workspace/new/hi.txt"
    assert files.exists("/workspace/hello.txt") is False
    assert files.read("/workspace/new/hi.txt") == "héllo\n"

    files.remove("/workspace/new")
    assert files.exists("/workspace/new") is False
    with pytest.raises(FileNotFoundException):
        files.read("/workspace/new/hi.txt")
    with pytest.raises(FileNotFoundException):
        files.remove("/workspace/new")
    with pytest.raises(InvalidArgumentException):
        files.list("relative/path")
    # File metadata (xattrs) is not kept: refused, and nothing is written without it.
    with pytest.raises(InvalidArgumentException, match="metadata"):
        files.write("/workspace/meta.txt", "x", metadata={"owner": "me"})
    assert files.exists("/workspace/meta.txt") is False
    # make_dir, rename and remove ran as operations
    ids = Operation.objects.filter(sandbox__external_id=sbx.sandbox_id).values_list(
        "operation_id", flat=True
    )
    assert sum(1 for i in ids if i.startswith("e2b-fs-")) == 3
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_streams_a_50_mb_file_both_ways(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    data = os.urandom(50 * 1024 * 1024)
    sbx.files.write("/workspace/big.bin", data)
    assert sbx.commands.run("stat -c %s /workspace/big.bin").stdout.strip() == str(len(data))
    assert bytes(sbx.files.read("/workspace/big.bin", format="bytes")) == data
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_watches_a_directory_through_the_sync_and_async_sdk(live, make_tenant):
    import asyncio
    import time

    from e2b import AsyncSandbox, FilesystemEventType, NotFoundException

    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    sbx.files.make_dir("/workspace/w/sub")
    handle = sbx.files.watch_dir("/workspace/w", recursive=True)
    assert handle.get_new_events() == []
    sbx.files.write("/workspace/w/a.txt", "a")
    sbx.files.write("/workspace/w/sub/b.txt", "b")
    seen = {(e.type, e.name) for e in handle.get_new_events()}
    assert seen == {
        (FilesystemEventType.CREATE, "a.txt"),
        (FilesystemEventType.CREATE, "sub/b.txt"),
    }
    sbx.files.write("/workspace/w/a.txt", "longer")
    sbx.files.rename("/workspace/w/sub/b.txt", "/workspace/w/c.txt")
    seen = {(e.type, e.name) for e in handle.get_new_events()}
    assert seen == {
        (FilesystemEventType.WRITE, "a.txt"),
        (FilesystemEventType.RENAME, "sub/b.txt"),
        (FilesystemEventType.CREATE, "c.txt"),
    }
    handle.stop()
    with pytest.raises(Exception):  # noqa: B017 - the SDK's own "already stopped"
        handle.get_new_events()
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir("/workspace/nope")

    async def watch_async() -> list[tuple[object, str]]:
        asbx = await AsyncSandbox.connect(sbx.sandbox_id, **opts(live, secret))
        got: list[tuple[object, str]] = []
        watcher = await asbx.files.watch_dir(
            "/workspace/w", on_event=lambda e: got.append((e.type, e.name)), timeout=60
        )
        await asbx.files.write("/workspace/w/new.txt", "n")
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline, "no event reached on_event"
            await asyncio.sleep(0.05)
        await watcher.stop()
        return got

    assert asyncio.run(watch_async()) == [(FilesystemEventType.CREATE, "new.txt")]
    sbx.kill()
    wait_all_deleted(tenant)


def test_watch_events_carry_the_entry_when_asked_sync_and_async(live, make_tenant):
    """``include_entry=True`` (envd 0.6.3): each event of a name that exists after the
    change carries its EntryInfo; a removed name carries none."""
    import asyncio
    import time

    from e2b import AsyncSandbox, FilesystemEvent, FilesystemEventType

    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    sbx.files.make_dir("/workspace/e")
    plain = sbx.files.watch_dir("/workspace/e")
    handle = sbx.files.watch_dir("/workspace/e", include_entry=True)
    sbx.files.write("/workspace/e/a.txt", "abc")
    sbx.commands.run("chmod 0751 /workspace/e/a.txt && ln -s a.txt /workspace/e/link")
    events = {(e.type, e.name): e for e in handle.get_new_events()}
    assert set(events) == {
        (FilesystemEventType.CREATE, "a.txt"),
        (FilesystemEventType.CREATE, "link"),
    }
    entry = events[(FilesystemEventType.CREATE, "a.txt")].entry
    assert entry is not None
    assert (entry.name, entry.path, entry.type, entry.size) == (
        "a.txt",
        "/workspace/e/a.txt",
        FileType.FILE,
        3,
    )
    assert entry.mode == 0o751 and entry.permissions == "-rwxr-x--x"
    link = events[(FilesystemEventType.CREATE, "link")].entry
    assert link is not None and link.symlink_target == "a.txt"
    # A watcher that did not ask gets no entries.
    assert all(e.entry is None for e in plain.get_new_events())
    sbx.files.remove("/workspace/e/a.txt")
    removed = handle.get_new_events()
    assert [(e.type, e.name, e.entry) for e in removed] == [
        (FilesystemEventType.REMOVE, "a.txt", None)
    ]
    handle.stop()
    plain.stop()

    async def watch_async() -> list[FilesystemEvent]:
        asbx = await AsyncSandbox.connect(sbx.sandbox_id, **opts(live, secret))
        got: list[FilesystemEvent] = []
        watcher = await asbx.files.watch_dir(
            "/workspace/e", on_event=got.append, timeout=60, include_entry=True
        )
        await asbx.files.write("/workspace/e/new.txt", "12345")
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline, "no event reached on_event"
            await asyncio.sleep(0.05)
        await watcher.stop()
        return got

    (event,) = asyncio.run(watch_async())
    assert event.type == FilesystemEventType.CREATE and event.name == "new.txt"
    assert event.entry is not None and event.entry.size == 5
    assert event.entry.path == "/workspace/e/new.txt"
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_takes_gzip_uploads_and_refuses_bodies_that_are_not(live, make_tenant):
    """``files.write(…, gzip=True)`` (a gzip octet-stream body) is inflated as it
    streams; a body that is not gzip, or one cut short, writes nothing."""
    import gzip

    import httpx

    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    files = sbx.files
    files.write("/workspace/g.txt", "héllo gzip\n", gzip=True)
    assert files.read("/workspace/g.txt", gzip=True) == "héllo gzip\n"
    every_byte = bytes(range(256)) * 4096  # 1 MiB, streamed through the SDK's gzip
    files.write("/workspace/g.bin", io.BytesIO(every_byte), gzip=True)
    assert bytes(files.read("/workspace/g.bin", format="bytes")) == every_byte

    token = sbx._envd_access_token
    assert token is not None
    envd = httpx.Client(base_url=live.url + "/e2b/envd", timeout=60, trust_env=False)
    headers = {
        "X-Access-Token": token,
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "Content-Type": "application/octet-stream",
        "Content-Encoding": "gzip",
    }
    whole = gzip.compress(every_byte)
    for name, body in (("plain", b"not gzip at all"), ("cut", whole[: len(whole) // 2])):
        response = envd.post("/files", params={"path": f"/workspace/{name}"}, headers=headers,
                             content=body)  # fmt: skip
        assert response.status_code == 400, (name, response.text)
        assert files.exists(f"/workspace/{name}") is False
    response = envd.post(
        "/files",
        params={"path": "/workspace/br"},
        headers={**headers, "Content-Encoding": "br"},
        content=b"x",
    )
    assert response.status_code == 400 and files.exists("/workspace/br") is False
    sbx.kill()
    wait_all_deleted(tenant)
