"""One surface, both flavours (issue 26 defect 5): the async client has every public
call of the sync client with the same parameters and defaults, so they cannot drift;
and the calls the async client lacked (pty, keys) work against the real stack."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from hedgerow import (
    AsyncClient,
    AsyncCommandHandle,
    AsyncSandbox,
    AuthError,
    Client,
    CommandHandle,
    Sandbox,
)
from hedgerow.episode import AsyncEpisode, Episode
from hedgerow.images import AsyncImages, Images
from hedgerow.sandboxes import AsyncSandboxes, Sandboxes
from hedgerow.watch import AsyncWatcher, Watcher

from apps.tenancy.models import ApiKey

PAIRS = [
    (Client, AsyncClient),
    (Sandbox, AsyncSandbox),
    (CommandHandle, AsyncCommandHandle),
    (Images, AsyncImages),
    (Episode, AsyncEpisode),
    (Sandboxes, AsyncSandboxes),
    (Watcher, AsyncWatcher),
]
# Names that differ by design: asyncio's own conventions.
RENAMED = {"close": "aclose"}
ASYNC_ONLY = {"flush_if_due"}  # the async episode flushes from the event loop
# Sync methods that return iterators: their async twins return async iterators
# (plain methods, as ``async for`` wants), not coroutines.
ITERATORS = {"exec_stream", "iter_file", "output"}


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_it_keeps_the_async_surface_the_same_as_the_sync_one(sync, aio):
    def twin(name: str) -> str:
        return name if hasattr(aio, name) else RENAMED.get(name, name)

    assert public(aio) - ASYNC_ONLY == {twin(name) for name in public(sync)}
    for name in public(sync):
        sync_attr = inspect.getattr_static(sync, name)
        aio_attr = inspect.getattr_static(aio, twin(name))
        assert type(sync_attr) is type(aio_attr), name  # property / function alike
        if not inspect.isfunction(sync_attr) or sync_attr is aio_attr:
            continue  # a property, or one shared implementation (a common base class)
        sync_sig, aio_sig = inspect.signature(sync_attr), inspect.signature(aio_attr)
        described = [(p.name, p.kind, p.default) for p in sync_sig.parameters.values()]
        assert described == [(p.name, p.kind, p.default) for p in aio_sig.parameters.values()], (
            f"{sync.__name__}.{name}"
        )
        sync_is_coroutine = inspect.iscoroutinefunction(sync_attr)
        assert not sync_is_coroutine, name
        if name in ITERATORS or name in {"get_result"} or inspect.isgeneratorfunction(sync_attr):
            continue
        if name in ("start_heartbeats", "stop_heartbeats", "episode", "record_exec"):
            continue  # schedule work, or are context managers: plain in both
        assert inspect.iscoroutinefunction(aio_attr) or inspect.isasyncgenfunction(aio_attr), (
            f"{aio.__name__}.{name} should be awaitable"
        )


def test_it_gives_the_async_client_terminals_and_keys(live, make_tenant):
    tenant, secret = make_tenant()

    async def main() -> None:
        async with AsyncClient(live.url, secret) as hr:
            made = await hr.create_key("parity")
            listed = {key["id"] for key in await hr.list_keys()}
            assert made["id"] in listed and made["secret"]
            await hr.revoke_key(made["id"])
            async with await hr.create_sandbox() as sandbox:
                async with await sandbox.pty(["sh", "-c", "echo $((6*7)); exit 3"]) as term:
                    out = b""
                    while term.exit_code is None:
                        out += await term.read(timeout=30)
                    assert b"42" in out and term.exit_code == 3
                async with AsyncClient(live.url, "hr_bogus", cleanup=False) as bad:
                    with pytest.raises(AuthError):
                        await AsyncSandbox(bad, {"id": sandbox.id}).pty()

    asyncio.run(main())
    assert ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=False).count() == 1
