"""Billing's cold-path tasks: the daily usage roll-ups, budget notices and their
webhook. (The admission queue's drain and the ledgers' repair sweep act on sandboxes:
``apps.sandboxes.tasks``.)"""

from __future__ import annotations

from datetime import date, timedelta

from celery import shared_task
from django.utils import timezone

from apps.billing import notices, reports


@shared_task(soft_time_limit=600, time_limit=660)
def usage_rollup(day: str | None = None) -> int:
    """Rebuilds the daily roll-ups of ``day`` (ISO date), or of yesterday, today and the
    finished days a late write to the usage ledger made stale (``DailyUsageDay``)."""
    if day is not None:
        return reports.daily_usage_rebuild(day=date.fromisoformat(day))
    today = timezone.now().date()
    days = {today - timedelta(days=1), today, *reports.daily_usage_stale_days()}
    return sum(reports.daily_usage_rebuild(day=d) for d in sorted(days))


@shared_task(soft_time_limit=120, time_limit=150)
def budget_notices_check() -> int:
    """Records this month's crossed alerts and budgets (once each) and enqueues the
    webhook of every new one whose team has set one."""
    ids = notices.notices_check()
    for notice_id in ids:
        budget_webhook_post.delay(notice_id)
    return len(ids)


@shared_task(soft_time_limit=60, time_limit=90)
def budget_webhook_post(notice_id: int) -> str:
    """POSTs one notice to its team's webhook (a timeout, no redirects); the outcome is
    kept on the notice."""
    return notices.webhook_deliver(notice_id=notice_id)
