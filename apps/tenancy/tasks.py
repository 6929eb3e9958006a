"""Periodic upkeep of the tenancy tables."""

from __future__ import annotations

from celery import shared_task

from apps.tenancy.activity import activity_purge


@shared_task(soft_time_limit=300, time_limit=330)
def purge_activity() -> int:
    """Deletes activity entries past HEDGEROW_ACTIVITY_RETENTION_DAYS."""
    return activity_purge()
