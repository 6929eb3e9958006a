"""exists / remove / mkdir / rename in both clients (issue 26, what the field's SDKs
have), through the REST API with typed errors and tenants kept apart."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hedgerow import AsyncClient, Client, NotFound, ValidationError

pytestmark = pytest.mark.timeout(240)


def test_it_makes_renames_and_removes_files_and_directories(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        assert not sandbox.exists("/workspace/a")
        made = sandbox.mkdir("/workspace/a/b/c")
        assert (made.type, made.path) == ("directory", "/workspace/a/b/c")
        assert sandbox.mkdir("/workspace/a/b/c").type == "directory"  # idempotent
        sandbox.write_file("/workspace/a/b/c/f.txt", "data")
        moved = sandbox.rename("/workspace/a/b/c/f.txt", "/workspace/x/y/g.txt")
        assert (moved.type, moved.size) == ("file", 4)
        assert not sandbox.exists("/workspace/a/b/c/f.txt")
        assert sandbox.read_file("/workspace/x/y/g.txt") == b"data"
        sandbox.exec("ln -s /nowhere /workspace/broken")
        assert sandbox.exists("/workspace/broken")  # a broken link is still there

        with pytest.raises(ValidationError) as not_empty:
            sandbox.remove("/workspace/x")
        assert not_empty.value.code == "directory_not_empty"
        sandbox.remove("/workspace/x", recursive=True)
        assert not sandbox.exists("/workspace/x")
        with pytest.raises(NotFound):
            sandbox.remove("/workspace/x")
        with pytest.raises(NotFound):
            sandbox.rename("/workspace/nothing", "/workspace/else")
        with pytest.raises(ValidationError) as relative:
            sandbox.rename("/workspace/a", "relative/path")
        assert relative.value.field == "to"

        _, outsider = make_tenant()
        base = f"{live.url}/api/v1/sandboxes/{sandbox.id}/files"
        headers = {"Authorization": f"Bearer {outsider}"}
        for response in (
            httpx.post(f"{base}/mkdir", params={"path": "/workspace/z"}, headers=headers),
            httpx.post(
                f"{base}/rename", params={"path": "/workspace/a", "to": "/w/b"}, headers=headers
            ),
            httpx.delete(base, params={"path": "/workspace/a", "recursive": "1"}, headers=headers),
        ):
            assert response.status_code == 404
        assert sandbox.exists("/workspace/a") and not sandbox.exists("/workspace/z")


def test_it_does_the_same_in_the_async_client(live, make_tenant):
    tenant, secret = make_tenant()

    async def main() -> None:
        async with AsyncClient(live.url, secret) as hr:
            async with await hr.create_sandbox() as sandbox:
                assert (await sandbox.mkdir("/workspace/d")).type == "directory"
                await sandbox.write_file("/workspace/d/f", "1")
                await sandbox.rename("/workspace/d/f", "/workspace/e/f")
                assert await sandbox.exists("/workspace/e/f")
                await sandbox.remove("/workspace/e", recursive=True)
                assert not await sandbox.exists("/workspace/e")

    asyncio.run(main())
