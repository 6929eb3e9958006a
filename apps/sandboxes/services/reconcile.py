"""Reconciliation: backend inventory against the records, one round at a time.

* a resource whose sandbox has no record, or whose record is final (deleted, failed,
  lost), is a leak: it is removed and ``leak_reclaimed`` is written to the ledger;
* a ``ready`` record whose process/pod is gone becomes ``lost`` (reason
  ``resource_missing``);
* a ``provisioning`` record past its deadline becomes ``failed`` (reason
  ``provision_deadline``) and its resources are destroyed;
* warm pool members (``services/warm_pool.py``) are inventory without a record and
  are left alone; a member the backend no longer runs is dropped
  (``pool_member_vanished``), one stuck starting too (``pool_member_stuck``);
* what the backend must keep true is re-applied (``backend.converge()``: on Kubernetes
  the namespace's default-deny NetworkPolicy, server-side applied; a restoration is
  counted as ``namespace_policy_restored``);
* a ``requested`` record no worker picked up (task lost with the broker) is enqueued
  again (``provision_requeued``);
* a snapshot the backend keeps whose record is not ``capturing`` or ``ready`` (none,
  ``deleted``, ``failed``) is removed (``snapshot_leak_reclaimed``); a ``capturing``
  record whose worker vanished is failed (``snapshot_capture_lost``).

A round whose inventory listing fails is skipped: a transient error must never look
like "everything vanished". Rounds are serialized by a Postgres advisory lock, so any
number of reconcilers (beat, a manual run, a test) can run at once safely; every state
change is a compare-and-set on top of that.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone

from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import Backend, BackendError, InventoryItem
from apps.sandboxes.models import FINAL_STATES, ReconcileRun, Sandbox, State
from apps.sandboxes.services.lifecycle import sandbox_record_event, sandbox_transition
from apps.sandboxes.services.warm_pool import warm_pool_drop_vanished, warm_pool_member_ids

log = logging.getLogger(__name__)

# Kinds whose absence means the sandbox is not running (the agent lives in it).
RUNNING_KINDS = frozenset({"process", "pod"})
# Kinds a sandbox's destroy may not cover (a lease or root mount left by a provision
# that crashed before recording it): reclaimed by name after the destroy.
# A pod whose deletion its node never confirmed (node lost) needs a forced deletion.
AFTER_DESTROY_KINDS = frozenset({"image_lease", "sandbox_root", "pod_terminating"})
ACTOR = "reconciler"


def _lock_key() -> int:
    # One lock per installation: two instances sharing a database never block each other.
    return zlib.crc32(f"hedgerow-reconcile:{settings.HEDGEROW_INSTANCE}".encode())


@contextmanager
def advisory_lock(key: int) -> Iterator[bool]:
    """A session-level ``pg_try_advisory_lock``: yields whether this caller holds it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        if held:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])


def sandbox_uuid(hex_id: str | None) -> uuid.UUID | None:
    if not hex_id:
        return None
    try:
        return uuid.UUID(hex_id)
    except ValueError:
        return None


@dataclass
class InventoryView:
    """The inventory grouped by sandbox; unparseable names are orphans by themselves."""

    by_sandbox: dict[uuid.UUID, list[InventoryItem]] = field(default_factory=dict)
    unowned: list[InventoryItem] = field(default_factory=list)
    total: int = 0


def inventory_view(backend: Backend) -> InventoryView:
    """Lists the backend once. Raises BackendError when the listing is incomplete."""
    items = backend.inventory()
    grouped: dict[uuid.UUID, list[InventoryItem]] = defaultdict(list)
    unowned: list[InventoryItem] = []
    for item in items:
        sid = sandbox_uuid(item.sandbox_id)
        if sid is None:
            unowned.append(item)
        else:
            grouped[sid].append(item)
    return InventoryView(by_sandbox=dict(grouped), unowned=unowned, total=len(items))


def leak_reclaim(
    *, backend: Backend, sandbox_uuid_: uuid.UUID | None, items: list[InventoryItem], reason: str
) -> list[str]:
    """Removes one sandbox's leaked resources and records ``leak_reclaimed``.

    With a parseable sandbox id the backend's ``destroy`` removes everything in the
    right order (process before netns before directory); stray items that still
    remain, and resources whose name names no sandbox, go through ``reclaim``.
    Returns the kinds removed. Raises BackendError if something could not be removed.
    """
    kinds = sorted({item.kind for item in items})
    if sandbox_uuid_ is not None:
        backend.destroy(sandbox_uuid_.hex)
        for item in items:
            if item.kind in AFTER_DESTROY_KINDS:
                backend.reclaim(item)  # idempotent: a no-op when destroy removed it
    else:
        for item in items:
            backend.reclaim(item)
    record = Sandbox.objects.filter(pk=sandbox_uuid_).first() if sandbox_uuid_ else None
    if record is not None:
        sandbox_record_event(
            sandbox=record,
            event="leak_reclaimed",
            reason=reason,
            message="removed: " + ", ".join(f"{i.kind}:{i.name}" for i in items)[:1900],
            actor=ACTOR,
        )
    log.warning(
        "reclaimed leaked resources (%s): %s",
        reason,
        ", ".join(kinds),
        extra={"sandbox_id": str(sandbox_uuid_) if sandbox_uuid_ else None, "event": "leak"},
    )
    return kinds


def _provision_deadline(now: datetime) -> datetime:
    return now - timedelta(seconds=settings.HEDGEROW_PENDING_TIMEOUT_S)


def sandbox_reconcile(*, now: datetime | None = None, reclaim: bool = True) -> ReconcileRun:
    """One reconciliation round; returns its stored ``ReconcileRun``.

    Safe to run concurrently (advisory lock; losers store a skipped round) and after
    any crash (every action is idempotent). Skips the round without acting when the
    backend inventory cannot be listed completely.
    """
    backend = get_backend()
    run = ReconcileRun.objects.create(backend=backend.name)
    actions: dict[str, int] = defaultdict(int)
    details: list[dict[str, Any]] = []
    with advisory_lock(_lock_key()) as held:
        if not held:
            return _finish(run, skipped="another reconciler is running")
        # Taken before listing: anything that became ready after this instant may not
        # be in the listing yet, so it is not judged this round.
        listed_at = now or timezone.now()
        try:
            view = inventory_view(backend)
        except BackendError as exc:
            log.warning("reconcile skipped: inventory failed: %s", exc)
            return _finish(run, skipped=f"inventory failed: {exc}"[:200])
        run.inventory_items = view.total
        # Pool members before records: a member claimed in between is then in one of
        # the two reads (read the other way round it could be in neither, and a
        # just-claimed sandbox would be reclaimed as a leak).
        members = warm_pool_member_ids()
        records = {
            s.id: s
            for s in Sandbox.objects.filter(pk__in=list(view.by_sandbox)).only("id", "state")
        }
        if reclaim:
            for sid, items in view.by_sandbox.items():
                record = records.get(sid)
                if record is not None and record.state not in FINAL_STATES:
                    continue
                if record is None and sid in members:
                    continue  # a warm pool member: backend inventory without a sandbox yet
                reason = "no_record" if record is None else f"record_{record.state}"
                _reclaim_counted(backend, sid, items, reason, actions, details)
            if view.unowned:
                _reclaim_counted(backend, None, view.unowned, "unparseable_name", actions, details)
        running = {sid for sid, items in view.by_sandbox.items() if _running(items)}
        for reason, n in warm_pool_drop_vanished(running_ids=running, listed_at=listed_at).items():
            actions[reason] += n
        _converge(backend, actions, details)
        _mark_lost(view, listed_at, actions, details)
        _fail_overdue(listed_at, actions, details)
        _requeue_stalled(listed_at, actions, details)
        _reconcile_snapshots(backend, listed_at, reclaim, actions, details)
    run.details = details
    return _finish(run, actions=dict(actions))


def _converge(backend: Backend, actions: dict[str, int], details: list[dict[str, Any]]) -> None:
    """What the backend must keep true whatever happens to it (the Kubernetes
    namespace's default-deny policy, re-applied): ``backend.converge()`` when it has
    one, its restorations counted."""
    converge = getattr(backend, "converge", None)
    if converge is None:
        return
    try:
        restored: dict[str, int] = converge()
    except BackendError as exc:
        actions["converge_error"] += 1
        details.append({"action": "converge_error", "error": str(exc)[:200]})
        return
    for what, count in restored.items():
        if count:
            actions[what] += count
            details.append({"action": what, "count": count})


def _running(items: list[InventoryItem]) -> bool:
    return any(item.kind in RUNNING_KINDS for item in items)


def _reclaim_counted(
    backend: Backend,
    sid: uuid.UUID | None,
    items: list[InventoryItem],
    reason: str,
    actions: dict[str, int],
    details: list[dict[str, Any]],
) -> None:
    try:
        kinds = leak_reclaim(backend=backend, sandbox_uuid_=sid, items=items, reason=reason)
    except BackendError as exc:
        actions["reclaim_error"] += 1
        details.append({"sandbox_id": str(sid), "action": "reclaim_error", "error": str(exc)})
        return
    actions["leak_reclaimed"] += 1
    details.append(
        {"sandbox_id": str(sid) if sid else None, "action": "leak_reclaimed", "reason": reason}
        | {"kinds": kinds}
    )


def _mark_lost(
    view: InventoryView,
    listed_at: datetime,
    actions: dict[str, int],
    details: list[dict[str, Any]],
) -> None:
    candidates = Sandbox.objects.filter(state=State.READY, ready_at__lt=listed_at)
    for sandbox in candidates.iterator():
        kinds = {item.kind for item in view.by_sandbox.get(sandbox.id, [])}
        if kinds & RUNNING_KINDS:
            continue
        missing = "no resources at all" if not kinds else "no running process"
        if sandbox_transition(
            sandbox=sandbox,
            from_states=(State.READY,),
            to_state=State.LOST,
            reason="resource_missing",
            actor=ACTOR,
            message=f"the backend lists {missing} for this sandbox",
            terminated_at=timezone.now(),
        ):
            _destroy_residue(sandbox)
            actions["resource_missing"] += 1
            details.append({"sandbox_id": str(sandbox.id), "action": "lost"})


def _fail_overdue(
    listed_at: datetime, actions: dict[str, int], details: list[dict[str, Any]]
) -> None:
    overdue = Sandbox.objects.filter(
        state=State.PROVISIONING, provisioning_started_at__lt=_provision_deadline(listed_at)
    )
    for sandbox in overdue.iterator():
        if sandbox_transition(
            sandbox=sandbox,
            from_states=(State.PROVISIONING,),
            to_state=State.FAILED,
            reason="provision_deadline",
            actor=ACTOR,
            message="still provisioning after the deadline (worker lost?)",
            terminated_at=timezone.now(),
        ):
            _destroy_residue(sandbox)
            actions["provision_deadline"] += 1
            details.append({"sandbox_id": str(sandbox.id), "action": "failed"})


def _requeue_stalled(
    listed_at: datetime, actions: dict[str, int], details: list[dict[str, Any]]
) -> None:
    """A ``requested`` sandbox nobody picked up (its task was lost with the broker, or
    the enqueue after commit failed) is enqueued again. Provisioning claims by
    compare-and-set, so a duplicate task is harmless."""
    from apps.sandboxes.tasks import provision_sandbox

    cutoff = listed_at - timedelta(seconds=settings.HEDGEROW_REQUEUE_AFTER_S)
    for sandbox in Sandbox.objects.filter(state=State.REQUESTED, updated_at__lt=cutoff):
        try:
            provision_sandbox.delay(str(sandbox.id))
        except Exception as exc:  # noqa: BLE001 - the broker may be what is down
            actions["requeue_error"] += 1
            details.append(
                {"sandbox_id": str(sandbox.id), "action": "requeue_error"}
                | {"error": str(exc)[:200]}
            )
            return
        # Touch updated_at so the next round waits again before re-enqueueing.
        Sandbox.objects.filter(pk=sandbox.pk, state=State.REQUESTED).update(
            updated_at=timezone.now()
        )
        sandbox_record_event(
            sandbox=sandbox, event="provision_requeued", reason="stalled_request", actor=ACTOR
        )
        actions["provision_requeued"] += 1
        details.append({"sandbox_id": str(sandbox.id), "action": "provision_requeued"})


def _reconcile_snapshots(
    backend: Backend,
    listed_at: datetime,
    reclaim: bool,
    actions: dict[str, int],
    details: list[dict[str, Any]],
) -> None:
    """Snapshots (docs/snapshots.md) are backend state outside any sandbox: the ids
    the backend keeps against the records. Listed before the records are read: a
    capture writes its record (``capturing``) before the backend copy exists."""
    from apps.sandboxes.models import Snapshot, SnapshotState

    listing = getattr(backend, "snapshots", None)
    if listing is None:
        return  # a backend that keeps none
    try:
        kept = {uuid.UUID(hex_id) for hex_id in listing()}
    except (BackendError, ValueError) as exc:
        actions["snapshot_listing_error"] += 1
        details.append({"action": "snapshot_listing_error", "error": str(exc)[:200]})
        return
    live = set(
        Snapshot.objects.filter(
            pk__in=list(kept), state__in=(SnapshotState.CAPTURING, SnapshotState.READY)
        ).values_list("pk", flat=True)
    )
    for snapshot_id in sorted(kept - live) if reclaim else []:
        try:
            backend.delete_snapshot(snapshot_id.hex)
        except BackendError as exc:
            actions["reclaim_error"] += 1
            details.append(
                {"snapshot_id": str(snapshot_id), "action": "reclaim_error", "error": str(exc)}
            )
            continue
        actions["snapshot_leak_reclaimed"] += 1
        details.append({"snapshot_id": str(snapshot_id), "action": "snapshot_leak_reclaimed"})
    stuck = Snapshot.objects.filter(
        state=SnapshotState.CAPTURING, created_at__lt=_provision_deadline(listed_at)
    ).select_related("sandbox")
    for snapshot in stuck:
        moved = Snapshot.objects.filter(pk=snapshot.pk, state=SnapshotState.CAPTURING).update(
            state=SnapshotState.FAILED,
            error={"code": "capture_lost", "message": "still capturing after the deadline"},
        )
        if moved:
            with contextlib.suppress(BackendError):
                backend.delete_snapshot(snapshot.id.hex)
            if snapshot.kind == "pause":
                # its compute was never released: the sandbox runs on, as after any
                # pause whose capture failed
                sandbox_transition(
                    sandbox=snapshot.sandbox,
                    from_states=(State.PAUSED,),
                    to_state=State.READY,
                    reason="pause_failed",
                    actor=ACTOR,
                    message="the pause's capture was lost",
                )
            actions["snapshot_capture_lost"] += 1
            details.append({"snapshot_id": str(snapshot.id), "action": "snapshot_capture_lost"})


def _destroy_residue(sandbox: Sandbox) -> None:
    """A sandbox that just ended here may still hold a netns or directory: remove it
    now so the next audit does not count it as leaked."""
    try:
        get_backend().destroy(sandbox.id.hex)
    except BackendError as exc:
        sandbox_record_event(sandbox=sandbox, event="destroy_error", message=str(exc), actor=ACTOR)


def _finish(
    run: ReconcileRun, *, skipped: str = "", actions: dict[str, int] | None = None
) -> ReconcileRun:
    run.finished_at = timezone.now()
    run.skipped = bool(skipped)
    run.skip_reason = skipped
    run.actions = actions or {}
    run.save()
    return run
