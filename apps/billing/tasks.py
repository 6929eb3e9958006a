"""Billing's cold-path tasks: admission queue drain, usage ledger repair, roll-ups."""

from __future__ import annotations

from datetime import date, timedelta

from celery import shared_task
from django.utils import timezone

from apps.billing import admission_queue, reports, storage, usage


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
    return usage.usage_sweep(full=full) + storage.storage_sweep()


@shared_task(soft_time_limit=600, time_limit=660)
def usage_rollup(day: str | None = None) -> int:
    """Rebuilds the daily roll-ups of ``day`` (ISO date), or of yesterday and today."""
    if day is not None:
        return reports.daily_usage_rebuild(day=date.fromisoformat(day))
    today = timezone.now().date()
    return reports.daily_usage_rebuild(day=today - timedelta(days=1)) + (
        reports.daily_usage_rebuild(day=today)
    )
