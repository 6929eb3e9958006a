"""A sandbox's egress: its DNS query log (the resolver's, read from the backend)."""

from __future__ import annotations

from typing import Any

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox

MAX_DNS_LOG = 1000


def sandbox_dns_log(*, sandbox: Sandbox, limit: int = MAX_DNS_LOG) -> list[dict[str, Any]]:
    """The sandbox's DNS queries as the instance's resolver logged them, oldest first:
    ts, generation, name, type, allowed, rcode, answer [{address, ttl}], flags. Empty
    for a backend without a resolver, and once the sandbox's backend state is gone."""
    reader = getattr(get_backend(), "dns_log", None)
    if reader is None:
        return []
    entries: list[dict[str, Any]] = reader(sandbox.id.hex, max(1, min(limit, MAX_DNS_LOG)))
    return entries
