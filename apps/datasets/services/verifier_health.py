"""When a task's verifier becomes suspect (a reference check fails) or is cleared (a
later one passes), its already-closed episodes are attributed again in bulk: each moves
to class ``verifier`` (out of η's valid set) or back to what its verdict says, and every
move is recorded (``EpisodeReattribution``: from, to, the verdict's class, reason and
the task's evidence). Idempotent — an episode already attributed as the flag says is
not written — and bounded: one run handles at most ``BATCH`` episodes, then queues the
next batch (docs/trajectories.md "Per-task verifier health")."""

from __future__ import annotations

from typing import Any

from apps.datasets.attribution import SUSPECT_RULES
from apps.datasets.models import TaskHealth
from apps.trajectories.models import Episode, EpisodeStatus
from apps.trajectories.services.episodes import episode_reattribute

BATCH = 200


def task_episodes_reattribute(
    *, tenant_id: Any, task_id: str, after: str | None = None, limit: int = BATCH
) -> tuple[int, str | None]:
    """Re-attributes up to ``limit`` closed episodes of one tenant's task, in primary
    key order after ``after``. Returns (how many changed class, the cursor of the next
    batch or None when this was the last)."""
    health = TaskHealth.objects.filter(tenant_id=tenant_id, task_id=task_id).first()
    suspect = bool(health and health.verifier_suspect)
    facts = [f for f in (health.evidence if health else []) if f.get("rule") in SUSPECT_RULES]
    if suspect:
        cause = "task_verifier_suspect"
        reason = f"task {task_id} became verifier_suspect: " + "; ".join(
            str(f.get("detail") or f.get("rule")) for f in facts
        )
    else:
        cause = "task_verifier_cleared"
        reason = f"task {task_id}'s verifier is no longer suspect (a later reference run passed)"
    evidence = [
        {"source": "task", "task_id": task_id, "verifier_suspect": suspect, **f} for f in facts
    ]
    if not facts:
        evidence = [{"source": "task", "task_id": task_id, "verifier_suspect": suspect}]
    episodes = Episode.objects.filter(
        tenant_id=tenant_id, task_id=task_id, status=EpisodeStatus.CLOSED, imported=False
    ).order_by("pk")
    if after is not None:
        episodes = episodes.filter(pk__gt=after)
    batch = list(episodes[:limit])
    changed = 0
    for episode in batch:
        if episode_reattribute(episode=episode, cause=cause, reason=reason, evidence=evidence):
            changed += 1
    cursor = str(batch[-1].pk) if len(batch) == limit else None
    return changed, cursor
