"""Thin, idempotent Celery tasks: take ids, call services, retry transient errors."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from apps.sandboxes.admission import queue as admission_queue
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.metering import storage as storage_metering
from apps.sandboxes.metering import usage as usage_metering
from apps.sandboxes.services import provisioning


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=3,
    soft_time_limit=180,
    time_limit=240,
)
def provision_sandbox(self: Any, sandbox_id: str) -> None:
    provisioning.sandbox_provision(sandbox_id=sandbox_id)


@shared_task(soft_time_limit=120, time_limit=180)
def prepare_backend() -> None:
    """Sent once by each worker as it starts (controlplane/celery.py): the backend's
    share of a first provision, made before the first create instead of inside it."""
    provisioning.backend_prepare()


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=600,
    time_limit=660,
)
def provision_sandboxes(self: Any, sandbox_ids: list[str]) -> None:
    """A share of a fork's children, provisioned side by side in this process; each
    as ``provision_sandbox`` would (idempotent, so a redelivered share resumes)."""
    provisioning.sandbox_provision_many(sandbox_ids=sandbox_ids)


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=8,
    soft_time_limit=120,
    time_limit=180,
)
def destroy_sandbox(self: Any, sandbox_id: str) -> None:
    try:
        provisioning.sandbox_destroy(sandbox_id=sandbox_id)
    except BackendError as exc:
        raise self.retry(exc=exc, countdown=min(2**self.request.retries, 60)) from exc


@shared_task(soft_time_limit=60, time_limit=90)
def reap_sandboxes() -> dict[str, int]:
    return provisioning.sandbox_reap()


@shared_task(soft_time_limit=120, time_limit=180)
def reconcile_sandboxes() -> dict[str, int]:
    from apps.sandboxes.services.reconcile import sandbox_reconcile

    run = sandbox_reconcile()
    return {"skipped": int(run.skipped), **run.actions}


@shared_task(soft_time_limit=300, time_limit=400)
def audit_leaks() -> list[int]:
    from apps.sandboxes.services.audit import audit_scheduled

    return [run.pk for run in audit_scheduled()]


@shared_task(soft_time_limit=300, time_limit=400)
def run_audit(run_id: int) -> int | None:
    """A team's own audit (POST /api/v1/audits), computed here, not in the web."""
    from apps.sandboxes.services.audit import audit_fill

    run = audit_fill(run_id)
    return run.pk if run else None


@shared_task(soft_time_limit=600, time_limit=660)
def collect_image_cache() -> dict[str, Any]:
    from apps.sandboxes.services.image_cache import image_cache_collect

    return image_cache_collect()


@shared_task(soft_time_limit=120, time_limit=180)
def recover_operations() -> dict[str, int]:
    from apps.sandboxes.services.recovery import operation_recover_stale

    return operation_recover_stale()


# The warm pool's tasks share the cold queue with tenants' own provisioning; the pool
# never has more than HEDGEROW_WARM_POOL_MAX_WARMING members starting, so it cannot
# take more than that many worker slots from them.
# Beat's tick and the claims' debounced check: refills only once claims are quiet (or a
# refill was held back too long), see warm_pool_refill_when_due.
@shared_task(soft_time_limit=60, time_limit=90)
def warm_pool_refill(chained: bool = False) -> dict[str, int]:
    from apps.sandboxes.services.warm_pool import warm_pool_refill_when_due

    return warm_pool_refill_when_due(chained=chained)


@shared_task(acks_late=True, reject_on_worker_lost=True, soft_time_limit=180, time_limit=240)
def warm_member_provision(member_id: str) -> None:
    from apps.sandboxes.services.warm_pool import warm_member_provision as provision

    provision(member_id=member_id)


@shared_task(bind=True, acks_late=True, max_retries=5, soft_time_limit=120, time_limit=180)
def warm_member_destroy(self: Any, member_hex: str) -> None:
    from apps.sandboxes.services.warm_pool import warm_member_destroy as destroy

    try:
        destroy(member_hex=member_hex)
    except BackendError as exc:
        raise self.retry(exc=exc, countdown=min(2**self.request.retries, 60)) from exc


# Snapshots (services/snapshots.py): the capture holds the sandbox frozen for the
# snapshot ioctl only; hashing the tree takes longer for large states.
@shared_task(acks_late=True, reject_on_worker_lost=True, soft_time_limit=600, time_limit=660)
def capture_snapshot(snapshot_id: str) -> None:
    from apps.sandboxes.services.snapshots import snapshot_capture

    snapshot_capture(snapshot_id=snapshot_id)


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=8,
    soft_time_limit=120,
    time_limit=180,
)
def destroy_snapshot(self: Any, snapshot_id: str) -> None:
    from apps.sandboxes.services.snapshots import snapshot_destroy

    try:
        snapshot_destroy(snapshot_id=snapshot_id)
    except BackendError as exc:
        raise self.retry(exc=exc, countdown=min(2**self.request.retries, 60)) from exc


# -- admission queue and metering (billing decides and prices; these act on sandboxes)
@shared_task(soft_time_limit=120, time_limit=150)
def admission_drain() -> int:
    """Enqueued after commit whenever a sandbox ends, and by beat as a sweep."""
    return admission_queue.admission_queue_drain()


@shared_task(soft_time_limit=120, time_limit=150)
def admission_sweep() -> dict[str, int]:
    expired = admission_queue.admission_queue_expire()
    return {"expired": expired, "admitted": admission_queue.admission_queue_drain()}


@shared_task(soft_time_limit=300, time_limit=360)
def usage_sweep(full: bool = False) -> int:
    """Repairs the usage ledger and the storage ledger (what a crashed worker missed):
    minutely over the sandboxes that moved recently, daily over all (``full``)."""
    return usage_metering.usage_sweep(full=full) + storage_metering.storage_sweep(full=full)


@shared_task(soft_time_limit=60, time_limit=90)
def fold_metrics() -> int:
    """Moves the metric deltas the triggers wrote into their fold, so they stay few
    when nobody scrapes ``/metrics`` (services/metrics_tally.py). Returns how many
    tallies there are."""
    from apps.sandboxes.services.metrics_tally import tallies

    return len(tallies())


@shared_task(soft_time_limit=600, time_limit=660)
def apply_retention() -> dict[str, Any]:
    """Bounded (``HEDGEROW_RETENTION_MAX_BATCHES`` × ``HEDGEROW_RETENTION_BATCH``) and
    idempotent: beat runs it every ``HEDGEROW_RETENTION_INTERVAL_S``."""
    from apps.sandboxes.services.retention import retention_apply

    return retention_apply().as_dict()
