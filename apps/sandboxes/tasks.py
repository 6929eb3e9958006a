"""Thin, idempotent Celery tasks: take ids, call services, retry transient errors."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from apps.sandboxes.backends.base import BackendError
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


@shared_task(soft_time_limit=120, time_limit=180)
def recover_operations() -> dict[str, int]:
    from apps.sandboxes.services.recovery import operation_recover_stale

    return operation_recover_stale()
