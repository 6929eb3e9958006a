"""E2B's pause, and connect/resume of a paused sandbox, on Hedgerow's pause and
resume (docs/snapshots.md, docs/e2b.md).

Hedgerow keeps a paused sandbox's files, never its process memory (no CRIU here): an
E2B ``filesystem`` pause (``memory: false``) is exactly that, and resuming it
cold-boots the sandbox from its files, as E2B does. A ``full`` pause (E2B's default,
``memory`` unset or true) would promise running processes back: it is refused with a
typed 400 naming the mode that works, never silently downgraded.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from apps.core.errors import ApiError, Conflict, ValidationFailed
from apps.e2b.services import e2b_sandbox_get
from apps.sandboxes.models import Sandbox, Snapshot, SnapshotState, State
from apps.sandboxes.services.snapshots import PAUSE, sandbox_pause, sandbox_resume
from apps.sandboxes.services.waiting import sandbox_wait_settled
from apps.tenancy.principal import Principal

PAUSE_WAIT_S = 120.0  # a pause answers once its capture ended (E2B's pause is synchronous)


def _memory(data: dict[str, Any], *, unset_means_memory: bool) -> bool:
    memory = data.get("memory")
    if memory is not None and not isinstance(memory, bool):
        raise ValidationFailed("memory must be a boolean", field="memory")
    return unset_means_memory if memory is None else memory


def _pause_of(sandbox: Sandbox) -> Snapshot | None:
    return (
        Snapshot.objects.filter(sandbox=sandbox, kind=PAUSE, generation=sandbox.generation)
        .exclude(state=SnapshotState.DELETED)
        .order_by("-created_at")
        .first()
    )


def _wait_captured(sandbox: Sandbox, deadline: float) -> Sandbox:
    """Until the running pause ended: paused with its state kept and its compute
    released, or back to ready (the capture failed). Polls the rows (a capture takes
    tens of ms to seconds)."""
    while True:
        sandbox.refresh_from_db()
        snapshot = _pause_of(sandbox)
        if sandbox.state != State.PAUSED or snapshot is None:
            return sandbox
        if snapshot.state in (SnapshotState.FAILED, SnapshotState.DELETED):
            return sandbox
        released = sandbox.events.filter(
            event__in=("compute_released", "destroy_error"), at__gte=snapshot.created_at
        )
        if snapshot.state == SnapshotState.READY and released.exists():
            return sandbox
        if time.monotonic() > deadline:
            raise ApiError(
                "the pause is still being captured", code="sandbox_pausing", status_code=504
            )
        time.sleep(0.05)


def e2b_sandbox_pause(*, principal: Principal, sandbox_id: str, data: dict[str, Any]) -> bool:
    """``POST /sandboxes/{id}/pause``: True once paused (its files kept, its compute
    released), False if it was paused already (E2B's 409)."""
    if _memory(data, unset_means_memory=True):
        raise ValidationFailed(
            "Hedgerow keeps a paused sandbox's files, not its memory: pause with "
            "mode='filesystem' (memory: false); resuming cold-boots it from its files",
            field="memory",
        )
    sandbox = e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    if sandbox.state == State.PAUSED:
        return False
    sandbox_pause(sandbox=sandbox, actor=principal.actor)
    sandbox = _wait_captured(sandbox, time.monotonic() + PAUSE_WAIT_S)
    if sandbox.state != State.PAUSED:
        snapshot = (
            Snapshot.objects.filter(sandbox=sandbox, kind=PAUSE).order_by("-created_at").first()
        )
        error = (snapshot.error if snapshot is not None else None) or {}
        raise ApiError(
            f"the pause failed, the sandbox runs on: {error.get('message', 'unknown')}",
            code=str(error.get("code") or "pause_failed"),
            status_code=429 if error.get("code") == "quota_exceeded" else 500,
        )
    return True


def e2b_sandbox_connect(*, principal: Principal, sandbox_id: str, data: dict[str, Any]) -> bool:
    """``POST /v2/sandboxes/{id}/connect`` (and the older ``…/resume``): a running
    sandbox is answered at once; a paused one is resumed (admitted like a create: 429
    over a limit, and it stays paused), restored from its files under a new
    generation, and answered once ready. True when it was resumed (E2B's 201)."""
    _memory(data, unset_means_memory=False)
    sandbox = e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    if sandbox.state != State.PAUSED:
        return False
    if data.get("memory") is True:
        raise ValidationFailed(
            "this sandbox was paused without its memory: resume it with "
            "on_resume='reboot' or the default",
            field="memory",
        )
    deadline = time.monotonic() + PAUSE_WAIT_S
    sandbox = _wait_captured(sandbox, deadline)
    if sandbox.state == State.PAUSED:
        try:
            sandbox_resume(sandbox=sandbox, actor=principal.actor)
        except Conflict as exc:  # resumed by a concurrent connect: wait for it below
            if exc.code != "sandbox_not_paused":
                raise
        sandbox.refresh_from_db()
    settled = sandbox_wait_settled(sandbox=sandbox, timeout_s=settings.HEDGEROW_E2B_CREATE_WAIT_S)
    if settled.state != State.READY:
        raise ApiError(
            f"the sandbox did not resume ({settled.state}"
            + (f": {settled.status_message}" if settled.status_message else "")
            + ")",
            code="sandbox_not_ready",
            status_code=504 if settled.state in (State.REQUESTED, State.PROVISIONING) else 500,
        )
    return True
