"""The process's one synchronous Redis client (``settings.REDIS_URL``): exec limits and
leases (billing), state events and stream replay (sandboxes), Orchard jobs. The event
loop's own driver is ``redis_async.py``."""

from __future__ import annotations

import functools

import redis
from django.conf import settings


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)
