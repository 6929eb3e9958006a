"""Django's ASGI handler with the middleware chain run synchronously, in one hop.

Every view here is synchronous (DRF, the dashboard), and so is ``RequestIdMiddleware``
and WhiteNoise. Django's stock ``ASGIHandler`` builds an *async* middleware chain:
each ``MiddlewareMixin`` then runs its ``process_request`` and ``process_response``
through ``sync_to_async`` and a sync-only middleware calls the rest of the chain
back through ``async_to_sync`` — about a dozen event loop ↔ thread round trips per
request (futures, a condition variable, a self-pipe wake-up each), which py-spy put at
about half of the web process's CPU for a one-row DRF read (docs/benchmarks.md).

Here the chain is loaded in sync mode, as under WSGI, and the whole of
``get_response`` (URL resolution, every middleware, the view, rendering) runs in the
request's thread in one ``sync_to_async`` call: the same middleware, in the same
order, with the same results — only the thread hops go. An async view would still
work (Django wraps it in ``async_to_sync``); there is none.

Each request still gets a thread of its own (a wait blocks its thread for up to its
timeout, so requests cannot share a small pool), but not a *new* one: the stock
handler's ``ThreadSensitiveContext`` starts and joins a thread per request (~0.16 ms
of CPU), while here an idle one-thread executor is taken from ``RequestThreads`` and
given back after the response, unless its thread is still busy (a request whose
client went away while the view ran) — that one is shut down when it finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponseBase


class _OneThread(ThreadPoolExecutor):
    """A one-thread executor that knows whether it still runs or holds any call."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="hedgerow-request")
        self._lock = threading.Lock()
        self._pending = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            self._pending += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _f: self._release())
        return future

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0


class RequestThreads:
    """Idle one-thread executors for requests, used from the event loop's thread only.
    At most ``max_idle`` are kept; a busy one is never handed out again."""

    def __init__(self, max_idle: int = 64) -> None:
        self.max_idle = max_idle
        self._idle: list[_OneThread] = []

    def lease(self) -> _OneThread:
        return self._idle.pop() if self._idle else _OneThread()

    def give_back(self, executor: _OneThread) -> None:
        if executor.idle and len(self._idle) < self.max_idle:
            self._idle.append(executor)
        else:
            executor.shutdown(wait=False)  # its thread exits once its call returns


class SyncChainASGIHandler(ASGIHandler):
    def __init__(self) -> None:
        base.BaseHandler.__init__(self)
        self.load_middleware(is_async=False)
        self.request_threads = RequestThreads()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # as ASGIHandler.__call__
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        executor = self.request_threads.lease()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            self.request_threads.give_back(executor)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        # thread_sensitive: the request's own thread (ASGIHandler.__call__ opens a
        # ThreadSensitiveContext), where request_started ran and response.close() runs,
        # so the request's DB connection is opened and given back in one thread.
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)
