"""The in-cluster resolver's query log (docs/egress.md "Kubernetes"): one bounded Redis
list per sandbox, the entries the local resolver writes to its dns.jsonl (ts,
generation, name, type, allowed, rcode, answer, flags). The resolver (resolver.py
here) appends; the control plane reads it for ``GET /api/v1/sandboxes/{id}/dns``, the
sandbox page and episode evidence, as it reads the local backend's file.

A list outlives its sandbox by ``TTL_S`` after its last query at most (it is never
written again once the sandbox is gone); episodes keep their own copy."""

from __future__ import annotations

import json
from typing import Any, Protocol

MAX_ENTRIES = 1000  # services/egress.py MAX_DNS_LOG
TTL_S = 24 * 3600


class _Redis(Protocol):
    def pipeline(self) -> Any: ...

    def lrange(self, name: str, start: int, end: int) -> Any: ...


def key(instance: str, sandbox_id: str) -> str:
    return f"hedgerow:{instance}:dns:{sandbox_id}"


def append(redis: _Redis, instance: str, sandbox_id: str, entry: dict[str, Any]) -> None:
    k = key(instance, sandbox_id)
    pipe = redis.pipeline()
    pipe.rpush(k, json.dumps(entry, separators=(",", ":")))
    pipe.ltrim(k, -MAX_ENTRIES, -1)
    pipe.expire(k, TTL_S)
    pipe.execute()


def read(redis: _Redis, instance: str, sandbox_id: str, limit: int) -> list[dict[str, Any]]:
    """The last ``limit`` entries, oldest first ([] when the sandbox asked nothing)."""
    out = []
    for raw in redis.lrange(key(instance, sandbox_id), -max(1, limit), -1):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out
