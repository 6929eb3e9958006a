"""Episodes of a task whose verifier is suspect are class ``verifier``: the verifier failed
the task's reference solution (or passed its initial state), so its verdict on a policy
says nothing about the policy. Registered with trajectories' attribution, which cannot
import this app (docs/trajectories.md "Failure attribution", rule 5)."""

from __future__ import annotations

from typing import Any

from apps.trajectories.models import Episode
from apps.trajectories.services.attribution import register_task_verifier_check

SUSPECT_RULES = frozenset({"verifier_fails_reference", "verifier_passes_initial_state"})


def task_verifier_suspect_facts(episode: Episode) -> list[dict[str, Any]]:
    from apps.datasets.models import TaskHealth

    health = TaskHealth.objects.filter(
        tenant_id=episode.tenant_id, task_id=episode.task_id, verifier_suspect=True
    ).first()
    if health is None:
        return []
    facts = [fact for fact in health.evidence if fact.get("rule") in SUSPECT_RULES]
    # a reference run keyed to a task version judges that version's episodes (and those
    # that name none); an episode of another version had a verifier no run found broken
    mine = [
        fact
        for fact in facts
        if not fact.get("task_version")
        or not episode.task_version
        or fact["task_version"] == episode.task_version
    ]
    if facts and not mine:
        return []
    return [
        {
            "class": "verifier",
            "source": "task",
            "detail": f"task {episode.task_id}: {fact.get('detail', fact.get('rule'))}",
            "rule": fact.get("rule"),
            **{
                k: fact[k]
                for k in ("task_version", "image_digest", "verifier_version")
                if k in fact
            },
        }
        for fact in mine
    ] or [
        {
            "class": "verifier",
            "source": "task",
            "detail": f"task {episode.task_id} is verifier_suspect",
        }
    ]


def connect() -> None:
    register_task_verifier_check("datasets.verifier_suspect", task_verifier_suspect_facts)
