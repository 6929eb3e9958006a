"""Backend events → ledger: a ready sandbox whose agent process vanished becomes ``lost``."""

from __future__ import annotations

from django.db import close_old_connections
from django.utils import timezone

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.lifecycle import sandbox_transition


def watch_backend_once(*, timeout_s: float) -> int:
    """Consumes backend events for up to ``timeout_s``; returns how many sandboxes it marked."""
    marked = 0
    for event in get_backend().watch(timeout_s):
        if event.kind not in ("gone", "failed"):
            continue
        close_old_connections()
        sandbox = Sandbox.objects.filter(pk=_uuid(event.sandbox_id)).first()
        if sandbox is None:
            continue
        if event.generation is not None and event.generation != sandbox.generation:
            continue  # an older generation's resource going away is expected
        if sandbox_transition(
            sandbox=sandbox,
            from_states=(State.READY,),
            to_state=State.LOST,
            # the backend's code when it knows why (evicted, node_lost,
            # resource_exhausted, …; docs/deploy-kubernetes.md "When a sandbox is lost")
            reason=event.code or "backend_resource_gone",
            actor="watcher",
            message=event.reason or "the sandbox's process exited unexpectedly",
            terminated_at=timezone.now(),
        ):
            marked += 1
    return marked


def _uuid(hex_id: str) -> str:
    import uuid

    try:
        return str(uuid.UUID(hex_id))
    except ValueError:
        return "00000000-0000-0000-0000-000000000000"
