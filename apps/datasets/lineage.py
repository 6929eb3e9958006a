"""Datasets are derived data: when a withdrawal (a licence pulled, a task retracted)
deletes episodes, every dataset that held them is named in the tombstone and keeps a
record of what it lost, so a team knows which splits and exports to rebuild."""

from __future__ import annotations

from typing import Any

from django.db.models import Count
from django.utils import timezone

from apps.datasets.models import Dataset, DatasetEpisode
from apps.trajectories.lineage_registry import Withdrawal, register_dependent


def datasets_affected(withdrawal: Withdrawal) -> list[dict[str, Any]]:
    """Runs inside the withdrawal's transaction, before the episodes go: removes their
    memberships and notes the loss on each dataset (``excluded.withdrawn``)."""
    members = DatasetEpisode.objects.filter(
        dataset__tenant=withdrawal.tenant, episode_id__in=withdrawal.episode_pks
    )
    lost = {row["dataset"]: row["n"] for row in members.values("dataset").annotate(n=Count("id"))}
    affected: list[dict[str, Any]] = []
    for dataset in Dataset.objects.filter(pk__in=lost).order_by("pk"):
        excluded = dict(dataset.excluded or {})
        history = list(excluded.get("withdrawn", []))
        history.append(
            {
                "episodes": lost[dataset.pk],
                "reason": withdrawal.reason,
                "by": withdrawal.actor,
                "at": timezone.now().isoformat(),
            }
        )
        excluded["withdrawn"] = history
        dataset.excluded = excluded
        dataset.save(update_fields=["excluded"])
        affected.append(
            {
                "kind": "dataset",
                "id": dataset.dataset_id,
                "name": dataset.name,
                "action": "members_removed",
                "episodes": lost[dataset.pk],
            }
        )
    members.delete()
    return affected


def connect() -> None:
    register_dependent("datasets", datasets_affected)
