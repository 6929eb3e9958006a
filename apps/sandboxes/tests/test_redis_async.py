"""The exec hot path's pipelined Redis client (apps/core/redis_async.py) against
the test Redis: what it sends is what redis-py sends, replies reach the caller that
asked, and a broken connection fails its callers and is replaced."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from django.conf import settings
from redis.asyncio.connection import Connection

from apps.core.redis_async import (
    RedisBatches,
    RedisPyBatches,
    ReplyError,
    batches_for_url,
    pack,
    parse,
)


def _run(loop_kind: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(fn())
    finally:
        loop.close()


def test_it_packs_commands_as_redis_py_does():
    command = ("EVALSHA", "abc", 3, "k:1", "", "k:2", 1700000000000, "lease", 2.5, 0, "é")
    packed = b"".join(Connection().pack_command(*command))
    assert pack(command) == packed
    with pytest.raises(TypeError):
        pack(("SET", "k", True))


def test_it_parses_every_resp2_reply_and_waits_for_a_whole_one():
    raw = b"*3\r\n:0\r\n$2\r\nhi\r\n*2\r\n+OK\r\n$-1\r\n-NOSCRIPT no\r\n"
    value, pos = parse(raw, 0)
    assert value == [0, b"hi", [b"OK", None]]
    error, end = parse(raw, pos)
    assert isinstance(error, ReplyError) and str(error) == "NOSCRIPT no" and end == len(raw)
    for cut in range(1, pos):
        with pytest.raises(Exception) as info:
            parse(raw[:cut], 0)
        assert type(info.value).__name__ == "_Incomplete"


def test_it_picks_the_pipelined_client_only_for_plain_urls():
    assert isinstance(batches_for_url("redis://127.0.0.1:6379/2"), RedisBatches)
    assert isinstance(batches_for_url("redis://:p%40ss@h:1/0"), RedisBatches)
    assert batches_for_url("redis://:p%40ss@h:1/0").setup == [("AUTH", "p@ss")]  # type: ignore[attr-defined]
    assert isinstance(batches_for_url("unix:///run/redis.sock"), RedisBatches)
    for url in ("rediss://h:6380/0", "redis://h:1/0?socket_timeout=1", "unix:///s?db=2"):
        assert isinstance(batches_for_url(url), RedisPyBatches), url


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_it_answers_concurrent_callers_in_order_on_one_connection(loop_kind):
    key = f"test:resp:{uuid.uuid4().hex}"

    async def scenario() -> None:
        client = batches_for_url(settings.REDIS_URL)
        assert isinstance(client, RedisBatches)
        try:
            replies = await asyncio.gather(
                *[client.run(("INCR", key), ("GET", key), ("BOGUS",)) for _ in range(20)]
            )
            counts = sorted(r[0] for r in replies)
            assert counts == list(range(1, 21))
            assert all(r[1] == str(r[0]).encode() for r in replies)
            assert all(isinstance(r[2], ReplyError) for r in replies)
            # A caller that gives up does not shift the next caller's replies.
            slow = asyncio.ensure_future(client.run(("INCR", key)))
            await asyncio.sleep(0)  # sent, waiting for its reply
            slow.cancel()
            assert await client.run(("GET", key), ("DEL", key)) == [b"21", 1]
            assert slow.cancelled()
        finally:
            await client.close()

    _run(loop_kind, scenario)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_it_fails_waiting_callers_when_the_connection_breaks_and_reconnects(loop_kind):
    async def scenario() -> None:
        client = batches_for_url(settings.REDIS_URL)
        assert isinstance(client, RedisBatches)
        try:
            assert await client.run(("PING",)) == [b"PONG"]
            conn = client._conn
            assert conn is not None and conn.transport is not None
            waiting = asyncio.ensure_future(client.run(("BLPOP", f"test:{uuid.uuid4()}", 5)))
            await asyncio.sleep(0.05)
            conn.transport.abort()
            with pytest.raises(ConnectionError):
                await waiting
            assert await client.run(("PING",)) == [b"PONG"]
            assert client._conn is not conn
        finally:
            await client.close()

    _run(loop_kind, scenario)


def test_the_redis_py_fallback_gives_the_same_shape():
    key = f"test:resp:{uuid.uuid4().hex}"

    async def scenario() -> None:
        client = RedisPyBatches(settings.REDIS_URL)
        try:
            replies = await client.run(("SET", key, "v", "NX", "EX", 5), ("BOGUS",), ("DEL", key))
            assert replies[0] and isinstance(replies[1], ReplyError) and replies[2] == 1
        finally:
            await client.close()

    _run("asyncio", scenario)
