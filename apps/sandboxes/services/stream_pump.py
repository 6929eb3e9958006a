"""The streamed-exec pump as a task on the web process's event loop.

A thread per stream works, but each frame then pays for ``async_to_sync`` (a new
event loop, so a new channel-layer Redis connection) — tens of milliseconds on a
busy machine. On the ASGI loop the pump shares one agent client, one Redis client
and the channel layer's connections. Database writes run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import httpx
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections

from apps.sandboxes.agent_client import AgentError
from apps.sandboxes.services import replay, streaming
from apps.sandboxes.services.operations import result_fields

log = logging.getLogger(__name__)

_loop: asyncio.AbstractEventLoop | None = None
_http: httpx.AsyncClient | None = None
_redis: aioredis.Redis | None = None
_tasks: set[asyncio.Task[None]] = set()


def remember_loop() -> None:
    """Called from the ASGI app on each connection: the loop pumps will run on."""
    global _loop
    _loop = asyncio.get_running_loop()


def running_loop() -> asyncio.AbstractEventLoop | None:
    loop = _loop
    return loop if loop is not None and loop.is_running() and not loop.is_closed() else None


# Readers in this process that want a pump's frames as it stores them, without a round
# trip to the replay buffer (the E2B envd fast path): operation pk → queue of
# (client frame, result fields or None). A reader that falls LISTEN_MAX frames behind
# gets LAGGED and reads the replay buffer from where it was instead; END (None, None)
# means the operation ended without fields here (a failure): read the row.
LISTEN_MAX = 512
LAGGED = "lagged"
_listeners: dict[str, asyncio.Queue[Any]] = {}


def listen(operation_pk: str) -> asyncio.Queue[Any]:
    """Registers (before the pump starts) a queue that gets the pump's frames."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    _listeners[operation_pk] = queue
    return queue


def unlisten(operation_pk: str) -> None:
    _listeners.pop(operation_pk, None)


def _notify(operation_pk: str, item: Any) -> None:
    queue = _listeners.get(operation_pk)
    if queue is None:
        return
    if queue.qsize() >= LISTEN_MAX:
        _listeners.pop(operation_pk, None)
        queue.put_nowait(LAGGED)
        return
    queue.put_nowait(item)


def start_here(job: Any) -> None:
    """Starts a pump as a task on the running loop (the caller is on it)."""
    remember_loop()
    task = asyncio.get_running_loop().create_task(_pump(job))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def start_on_loop(loop: asyncio.AbstractEventLoop, job: Any) -> None:
    def spawn() -> None:
        task = loop.create_task(_pump(job))
        _tasks.add(task)  # keep a reference: the loop only holds weak ones
        task.add_done_callback(_tasks.discard)

    loop.call_soon_threadsafe(spawn)


def _new_http() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        limits=httpx.Limits(max_keepalive_connections=64, max_connections=512),
        timeout=httpx.Timeout(10.0),
        trust_env=False,
    )


def _clients() -> tuple[httpx.AsyncClient, aioredis.Redis]:
    global _http, _redis
    if _http is None:
        _http = _new_http()
    if _redis is None:
        _redis = aioredis.Redis.from_url(settings.REDIS_URL)
    return _http, _redis


def run_in_thread(job: Any) -> None:
    """The relay in a process that no event loop serves (a Celery worker, a management
    command): the same ``_pump`` on a private loop in this thread, with clients of its
    own (a client belongs to the loop it was made on)."""

    async def relay() -> None:
        http, redis = _new_http(), aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            await _pump(job, (http, redis))
        finally:
            await http.aclose()
            await redis.aclose()

    try:
        asyncio.run(relay())
    finally:
        close_old_connections()


def redis_client_async() -> aioredis.Redis:
    """This loop's Redis client (the pumps' own)."""
    return _clients()[1]


def _db(fn: Any) -> Any:
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False)


async def _append(
    redis: aioredis.Redis,
    operation_pk: str,
    frame: dict[str, Any],
    fields: dict[str, Any] | None = None,
    *,
    notify: bool = True,
) -> bool:
    data = json.dumps(frame, separators=(",", ":"))
    final = frame.get("type") == "exec.exit"
    if notify and not final:
        # A listener gets output before it is stored (the pump skips re-sent frames
        # by seq, so it never gets one twice); the end only once the row is final.
        _notify(operation_pk, (frame, fields))
    totals = await replay.append_async(redis, operation_pk, frame, data)
    if totals is None:
        return False  # already stored (a re-attach re-sends early frames)
    if notify and final:
        _notify(operation_pk, (frame, fields))
    layer = get_channel_layer()
    if layer is not None:
        try:
            await layer.group_send(
                streaming.operation_group(operation_pk),
                streaming.group_message(operation_pk, data, totals),
            )
        except Exception:  # noqa: BLE001 - subscribers fill gaps from the stream
            log.warning("could not fan out exec frame", extra={"operation": operation_pk})
    return True


async def _frames(http: httpx.AsyncClient, job: Any) -> Any:
    agent = job.agent
    async with http.stream(
        "POST",
        agent.base + "/exec",
        json={**job.body, "stream": True},
        headers=agent.headers,
        timeout=httpx.Timeout(10.0, read=job.timeout),
    ) as response:
        if response.status_code >= 400:
            await response.aread()
            try:
                err = response.json().get("error", {})
            except (ValueError, AttributeError):
                err = {}
            raise AgentError(
                response.status_code,
                str(err.get("code", "agent_error")),
                str(err.get("message", response.text[:200])),
                err.get("field"),
            )
        async for line in response.aiter_lines():
            if line:
                yield json.loads(line)


async def _pump(job: Any, clients: tuple[httpx.AsyncClient, aioredis.Redis] | None = None) -> None:
    pk = job.operation_pk
    http, redis = clients or _clients()
    on_loop = bool(getattr(job, "on_loop", False))
    # A pump started on the loop (exec_async) hands each frame to its listener at once
    # and stores it in the background, in order (each store waits for the one before),
    # so the next frame is not held up by the replay buffer and the fan-out; the end
    # goes to the listener once the row is final, then is stored after the rest.
    stored: asyncio.Future[Any] | None = None

    def store_later(frame: dict[str, Any]) -> None:
        nonlocal stored
        previous = stored

        async def store() -> None:
            if previous is not None:
                await previous
            await _append(redis, pk, frame, notify=False)

        _notify(pk, (frame, None))
        stored = asyncio.ensure_future(store())

    async def drain() -> None:
        """Frames handed over are stored before anything ends the operation (an end
        stored first would make the buffer refuse them: ids must grow)."""
        if stored is not None and not stored.done():
            with contextlib.suppress(Exception):
                await stored

    try:
        last = -1 if job.fresh else await _db(streaming.buffer_last_seq)(pk)
        for attempt in range(streaming.REATTACH_ATTEMPTS):
            try:
                async for agent_frame in _frames(http, job):
                    seq = int(agent_frame["seq"])
                    if seq <= last:
                        continue
                    if agent_frame.get("type") == "exit":
                        result = agent_frame.get("result") or {}
                        exit_frame = {"type": "exec.exit", "seq": seq}
                        if on_loop:
                            from apps.sandboxes.services import exec_async

                            fields: dict[str, Any] | None = result_fields(result)
                            assert fields is not None
                            if not await exec_async.finish_fields(pk, fields):
                                fields = None  # finished by someone else: read the row
                            _notify(pk, (exit_frame, fields))
                            if stored is not None:
                                await stored
                            await _append(redis, pk, exit_frame, notify=False)
                        else:
                            await _db(streaming.record_exit)(pk, result)
                            await _append(redis, pk, exit_frame)
                        return
                    if on_loop:
                        store_later(streaming.client_frame(agent_frame))
                    else:
                        await _append(redis, pk, streaming.client_frame(agent_frame))
                    last = seq
            except AgentError as exc:
                await drain()
                await _db(streaming.finish_failed)(pk, exc.code, exc.message, exc.kind)
                return
            except httpx.TransportError as exc:
                log.warning("agent stream broke; re-attaching", extra={"error": str(exc)})
                await asyncio.sleep(0.2 * (attempt + 1))
        await drain()
        await _db(streaming.finish_failed)(
            pk, "agent_unreachable", "the agent's stream broke repeatedly"
        )
    except asyncio.CancelledError:
        raise  # the web process is going away: recovery picks this operation up
    except Exception:
        log.exception("exec pump crashed", extra={"operation": pk})
        await drain()
        await _db(streaming.finish_failed)(pk, "internal_error", "the stream relay failed")
    finally:
        await drain()  # what was handed to the listener is stored too
        _notify(pk, (None, None))  # a listener still waiting: the end is in the row
        unlisten(pk)
        await _db(streaming.pumps.release)(pk)
        lease = getattr(job, "lease", None)
        if lease is not None:  # quotas (billing): the exec slot this stream held
            await _db(lease.release)()
