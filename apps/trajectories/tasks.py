"""Trajectories' periodic work."""

from __future__ import annotations

from celery import shared_task

from apps.trajectories.services.episodes import episodes_reattribute_recent


@shared_task(soft_time_limit=60, time_limit=90)
def reattribute_recent_episodes() -> int:
    """Beat: losses noticed within the detection grace after an episode closed."""
    return episodes_reattribute_recent()
