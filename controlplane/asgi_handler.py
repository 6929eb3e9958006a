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
order, with the same results — only the thread hops go. ``request_started``'s
receivers run in that same call, first (the stock handler gives them a hop of their
own): two hops per request in all, the second being ``response.close()`` after the
response is sent. An async view would still
work (Django wraps it in ``async_to_sync``); there is none.

Each request still gets a thread of its own (a wait blocks its thread for up to its
timeout, so requests cannot share a small pool), but not a *new* one: the stock
handler's ``ThreadSensitiveContext`` starts and joins a thread per request (~0.16 ms
of CPU), while here an idle one-thread executor is taken from ``RequestThreads`` and
given back after the response, unless its thread is still busy (a request whose
client went away while the view ran) — that one is shut down when it finishes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import HttpRequest, HttpResponseBase
from django.urls import set_script_prefix


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

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """``ASGIHandler.handle`` (Django 5.2) with one hop fewer: ``request_started`` is
        sent in the request's own hop, just before ``get_response``, not in a hop of its
        own before the request object is built (building it reads only the scope and the
        body). Same receivers, same thread, before the same middleware; a request Django
        cannot build (400/413) is answered exactly as the stock handler does it."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            assert error_response is not None
            await signals.request_started.asend(sender=self.__class__, scope=scope)
            body_file.close()
            await self.send_response(error_response, send)
            await sync_to_async(error_response.close)()
            return

        async def process_request(request: HttpRequest, send: Any) -> HttpResponseBase:
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client left while the response was sent
            return response

        # From here on as the stock handler: a disconnect while the view runs cancels
        # the answer (the thread finishes its call), then request_finished is sent.
        listening = asyncio.create_task(self.listen_for_disconnect(receive))
        answering = asyncio.create_task(process_request(request, send))
        await asyncio.wait((listening, answering), return_when=asyncio.FIRST_COMPLETED)
        task: asyncio.Task[Any]
        for task in (listening, answering):
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = answering.result()
        except asyncio.CancelledError:
            await signals.request_finished.asend(sender=self.__class__)
        else:
            await sync_to_async(response.close)()
        body_file.close()

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        # thread_sensitive: the request's own thread (ASGIHandler.__call__ opens a
        # ThreadSensitiveContext), where response.close() runs too, so the request's DB
        # connection is opened and given back in one thread.
        return await sync_to_async(self._started_and_response, thread_sensitive=True)(request)

    def _started_and_response(self, request: HttpRequest) -> HttpResponseBase:
        scope = request.scope  # type: ignore[attr-defined]  # an ASGIRequest
        signals.request_started.send(sender=self.__class__, scope=scope)
        return self.get_response(request)
