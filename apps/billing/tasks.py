"""Billing's cold-path tasks: the daily usage roll-ups. (The admission queue's drain and
the ledgers' repair sweep act on sandboxes: ``apps.sandboxes.tasks``.)"""

from __future__ import annotations

from datetime import date, timedelta

from celery import shared_task
from django.utils import timezone

from apps.billing import reports


@shared_task(soft_time_limit=600, time_limit=660)
def usage_rollup(day: str | None = None) -> int:
    """Rebuilds the daily roll-ups of ``day`` (ISO date), or of yesterday and today."""
    if day is not None:
        return reports.daily_usage_rebuild(day=date.fromisoformat(day))
    today = timezone.now().date()
    return reports.daily_usage_rebuild(day=today - timedelta(days=1)) + (
        reports.daily_usage_rebuild(day=today)
    )
