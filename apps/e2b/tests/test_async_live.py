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
