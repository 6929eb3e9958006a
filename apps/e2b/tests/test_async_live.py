"""The e2b asyncio client (AsyncSandbox) against the live stack."""

from __future__ import annotations

import asyncio

import pytest
from e2b import AsyncSandbox, CommandExitException, NotFoundException

from apps.e2b.tests.live import opts, wait_all_deleted
from apps.sandboxes.models import Operation
from apps.sandboxes.models import Sandbox as Row

N = 100


@pytest.mark.timeout(900)
def test_it_runs_100_sandboxes_concurrently_through_the_async_client(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)

    async def rollout(n: int) -> tuple[str, str]:
        sbx = await AsyncSandbox.create(metadata={"n": str(n)}, **o)
        try:
            result = await sbx.commands.run(f"echo rollout-{n}")
            await sbx.files.write(f"/workspace/{n}.txt", f"{n}")
            assert await sbx.files.read(f"/workspace/{n}.txt") == f"{n}"
            return sbx.sandbox_id, result.stdout
        finally:
            await sbx.kill()

    async def main() -> list[tuple[str, str]]:
        return await asyncio.gather(*(rollout(n) for n in range(N)))

    results = asyncio.run(main())
    assert [stdout for _, stdout in results] == [f"rollout-{n}\n" for n in range(N)]
    assert len({sandbox_id for sandbox_id, _ in results}) == N
    assert Row.objects.filter(tenant=tenant).count() == N
    assert Operation.objects.filter(sandbox__tenant=tenant, kind="exec").count() >= N
    wait_all_deleted(tenant, timeout=300)


@pytest.mark.timeout(240)
def test_it_serves_the_async_client_errors_and_foreign_tenants(live, make_tenant):
    tenant, secret = make_tenant()
    _, stranger = make_tenant()

    async def main() -> None:
        sbx = await AsyncSandbox.create(**opts(live, secret))
        with pytest.raises(CommandExitException) as failed:
            await sbx.commands.run("exit 3")
        assert failed.value.exit_code == 3
        with pytest.raises(NotFoundException):
            await AsyncSandbox.get_info(sbx.sandbox_id, **opts(live, stranger))
        assert await AsyncSandbox.kill(sbx.sandbox_id, **opts(live, stranger)) is False
        info = await sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        await sbx.kill()

    asyncio.run(main())
    wait_all_deleted(tenant)


@pytest.mark.timeout(300)
def test_the_async_client_covers_the_same_calls_as_the_sync_one(live, make_tenant):
    """Issue 19's list through ``AsyncSandbox``: create with metadata and envs, run with
    its fields and on_stdout, background + connect + wait, stdin, kill, a timeout, files
    (binary, list, make_dir, rename, remove), a terminal, list by metadata, set_timeout."""
    import datetime as dt

    from e2b import FileType, PtySize, SandboxQuery, TimeoutException

    tenant, secret = make_tenant()
    o = opts(live, secret)

    async def main() -> dict[str, object]:
        seen: dict[str, object] = {}
        sbx = await AsyncSandbox.create(metadata={"suite": "async"}, envs={"GREETING": "hi"}, **o)
        other = await AsyncSandbox.create(metadata={"suite": "other"}, **o)
        try:
            result = await sbx.commands.run("echo $GREETING; echo err >&2")
            assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "err\n", 0)
            got: list[str] = []
            await sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=got.append)
            assert "".join(got) == "1\n2\n3\n"

            background = await sbx.commands.run("echo bg; exit 4", background=True)
            again = await sbx.commands.connect(background.pid)
            with pytest.raises(CommandExitException) as failed:
                await again.wait()
            assert failed.value.exit_code == 4 and failed.value.stdout == "bg\n"

            cat = await sbx.commands.run("cat", background=True, stdin=True)
            await sbx.commands.send_stdin(cat.pid, "abc")
            await sbx.commands.close_stdin(cat.pid)
            assert (await cat.wait()).stdout == "abc"
            sleeper = await sbx.commands.run("sleep 300", background=True)
            assert await sbx.commands.kill(sleeper.pid) is True
            with pytest.raises(CommandExitException):
                await sleeper.wait()
            with pytest.raises(TimeoutException):
                await sbx.commands.run("sleep 30", timeout=1)

            every_byte = bytes(range(256)) * 16
            await sbx.files.write("/workspace/a/all.bin", every_byte)
            assert bytes(await sbx.files.read("/workspace/a/all.bin", format="bytes")) == every_byte
            assert await sbx.files.make_dir("/workspace/d") is True
            listed = {e.name: e.type for e in await sbx.files.list("/workspace")}
            assert listed["a"] == FileType.DIR and listed["d"] == FileType.DIR
            moved = await sbx.files.rename("/workspace/a/all.bin", "/workspace/d/moved.bin")
            assert moved.path == "/workspace/d/moved.bin"
            await sbx.files.remove("/workspace/a")
            assert await sbx.files.exists("/workspace/a") is False

            output: list[bytes] = []
            terminal = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=output.append)
            await sbx.pty.resize(terminal.pid, PtySize(rows=30, cols=90))
            await sbx.pty.send_stdin(terminal.pid, b"echo hel''lo-apty; stty size; exit 5\n")
            with pytest.raises(CommandExitException) as ended:
                await terminal.wait()
            assert ended.value.exit_code == 5
            text = b"".join(output).decode(errors="replace")
            assert "hello-apty" in text and "30 90" in text

            page = await AsyncSandbox.list(
                query=SandboxQuery(metadata={"suite": "async"}), **o
            ).next_items()
            assert [s.sandbox_id for s in page] == [sbx.sandbox_id]
            await sbx.set_timeout(600)
            seen["id"] = sbx.sandbox_id
        finally:
            await other.kill()
            seen["set_at"] = dt.datetime.now(dt.UTC)
        return seen

    seen = asyncio.run(main())
    row = Row.objects.get(external_id=seen["id"])
    left = (row.expires_at - seen["set_at"]).total_seconds()  # type: ignore[operator]
    assert 560 <= left <= 601
    assert Operation.objects.filter(sandbox=row, operation_id__startswith="e2b-").count() >= 8
    asyncio.run(AsyncSandbox.kill(str(seen["id"]), **o))
    wait_all_deleted(tenant)
