"""Datasets' background work: the reference check (services/reference_check.py)."""

from __future__ import annotations

from celery import shared_task

from apps.datasets.services.reference_check import MAX_VERIFIER_TIMEOUT_S, READY_TIMEOUT_S


# two verifier runs, the sandbox's start and the reference's writes, with room to spare
@shared_task(
    soft_time_limit=READY_TIMEOUT_S + 2 * MAX_VERIFIER_TIMEOUT_S + 300,
    time_limit=READY_TIMEOUT_S + 2 * MAX_VERIFIER_TIMEOUT_S + 360,
)
def run_reference_check(run_pk: int) -> str | None:
    from apps.datasets.services.reference_check import reference_check_run

    run = reference_check_run(run_pk=run_pk)
    return run.status if run is not None else None
