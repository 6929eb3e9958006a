"""Trajectories' periodic work."""

from __future__ import annotations

from celery import shared_task

from apps.trajectories.services.episodes import episodes_reattribute_recent
from apps.trajectories.services.tally import episode_tally_fold, episodes_settle_costs


@shared_task(soft_time_limit=60, time_limit=90)
def reattribute_recent_episodes() -> int:
    """Beat: losses noticed within the detection grace after an episode closed."""
    return episodes_reattribute_recent()


@shared_task(soft_time_limit=60, time_limit=90)
def settle_episode_costs() -> int:
    """Beat: store the final cost of closed episodes whose sandboxes have ended, then
    fold the list page's tally deltas (services/tally.py)."""
    settled = episodes_settle_costs()
    episode_tally_fold()
    return settled
