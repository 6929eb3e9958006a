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
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponseBase


class SyncChainASGIHandler(ASGIHandler):
    def __init__(self) -> None:
        base.BaseHandler.__init__(self)
        self.load_middleware(is_async=False)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        # thread_sensitive: the request's own thread (ASGIHandler.__call__ opens a
        # ThreadSensitiveContext), where request_started ran and response.close() runs,
        # so the request's DB connection is opened and given back in one thread.
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)
