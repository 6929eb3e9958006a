"""A dataset's data card (docs/datasets.md "Data cards"): what went in, from where, with
which outcomes and licences. Computed from the stored membership when asked."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from django.db.models import Count, OuterRef, Subquery

from apps.datasets.models import Dataset, DatasetEpisode, Task
from apps.trajectories.models import (
    INVALID_CLASSES,
    Episode,
    EpisodeRelabel,
    FailureClass,
    LayerItem,
    LayerKind,
    LineageLayer,
)
from apps.trajectories.services.secrets import secrets_report


def _summary(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
        "mean": sum(ordered) / len(ordered),
    }


def _latest_layers(episodes: Any, kind: str) -> Any:
    """Each episode's newest layer of ``kind`` (older versions stay in the lineage but
    would count an episode twice)."""
    newest = (
        LineageLayer.objects.filter(episode=OuterRef("episode"), kind=kind)
        .order_by("-version")
        .values("pk")[:1]
    )
    return LineageLayer.objects.filter(episode__in=episodes, kind=kind, pk=Subquery(newest))


def _segment_lengths(episodes: Any) -> dict[str, Any]:
    """Steps per segment, from each episode's newest segments layer (an item's sources
    are its ``[first, last]`` step range in the layer below)."""
    lengths: list[float] = []
    items = LayerItem.objects.filter(layer__in=_latest_layers(episodes, LayerKind.SEGMENTS))
    for sources in items.values_list("sources", flat=True):
        if (
            isinstance(sources, list)
            and len(sources) == 2
            and all(isinstance(x, int) for x in sources)
        ):
            lengths.append(float(sources[1] - sources[0] + 1))
    return {
        "available": True,
        "layer": "newest segments layer per episode",
        **({"summary": _summary(lengths)} if lengths else {"summary": None}),
    }


def _lineage_retention(episodes: Any, n: int) -> dict[str, Any]:
    """How many of the dataset's episodes reached each lineage layer."""
    reached = dict(
        LineageLayer.objects.filter(episode__in=episodes)
        .order_by()
        .values("kind")
        .annotate(n=Count("episode", distinct=True))
        .values_list("kind", "n")
    )
    return {
        "available": True,
        "episodes": n,
        "layers": {
            kind: {
                "episodes": reached.get(kind, 0),
                "rate": reached.get(kind, 0) / n if n else None,
            }
            for kind in (LayerKind.NORMALIZED, LayerKind.SEGMENTS, LayerKind.PACKED)
        },
    }


def dataset_card(dataset: Dataset) -> dict[str, Any]:
    member_ids = DatasetEpisode.objects.filter(dataset=dataset).values("episode_id")
    episodes = Episode.objects.filter(pk__in=member_ids)
    rows = list(
        episodes.values_list(
            "failure_class",
            "termination_reason",
            "verifier_outcome",
            "reward",
            "failure_evidence",
            "resources",
            "task_id",
        )
    )
    n = len(rows)
    by_class = {cls: 0 for cls in FailureClass.values}
    by_reason: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    rewards: list[float] = []
    steps: list[float] = []
    for cls, reason, outcome, reward, evidence, resources, _ in rows:
        by_class[cls or FailureClass.UNDETERMINED] += 1
        by_reason[reason or "none"] += 1
        outcomes[outcome or "none"] += 1
        if reward is not None:
            rewards.append(float(reward))
        if isinstance(resources, dict) and isinstance(resources.get("steps"), int):
            steps.append(float(resources["steps"]))
        for fact in evidence if isinstance(evidence, list) else []:
            if isinstance(fact, dict) and fact.get("source"):
                sources[str(fact["source"])] += 1
    relabeled = (
        EpisodeRelabel.objects.filter(episode__in=episodes).values("episode").distinct().count()
    )
    if relabeled:
        sources["human_relabel"] += relabeled
    valid = n - sum(by_class[c] for c in INVALID_CLASSES)
    task_ids = {r[6] for r in rows}
    licences = Counter(
        (t.licence or "unrecorded")
        for t in Task.objects.filter(tenant_id=dataset.tenant_id, task_id__in=task_ids)
    )
    registered = sum(licences.values())
    if len(task_ids) > registered:
        licences["unrecorded"] += len(task_ids) - registered
    per_split = dict(
        DatasetEpisode.objects.filter(dataset=dataset)
        .values_list("split")
        .annotate(n=Count("pk"))
        .values_list("split", "n")
    )
    return {
        "dataset": dataset.dataset_id,
        "name": dataset.name,
        "source": {
            "filters": dataset.definition.get("filters", {}),
            "valid_only": dataset.definition.get("valid_only", False),
            "group_by": dataset.group_by,
            "fractions": dataset.definition.get("fractions"),
            "seed": dataset.definition.get("seed"),
            "temporal": dataset.definition.get("temporal"),
            "created_by": dataset.created_by,
            "created_at": dataset.created_at.isoformat(),
        },
        "episodes": n,
        "episodes_per_split": per_split,
        "splits": dataset.counts,
        "excluded": dataset.excluded,
        "leak_check": dataset.leak_check,
        "by_class": by_class,
        "by_termination_reason": dict(sorted(by_reason.items())),
        "valid": valid,
        "eta": valid / n if n else None,
        "evidence_sources": dict(sorted(sources.items())),
        "outcomes": {
            "verifier": dict(sorted(outcomes.items())),
            "reward": _summary(rewards),
            "success_rate_raw": by_class[FailureClass.SUCCESS] / n if n else None,
            "success_rate_valid": by_class[FailureClass.SUCCESS] / valid if valid else None,
        },
        "steps_per_episode": _summary(steps),
        "segment_lengths": _segment_lengths(episodes),
        "lineage_retention": _lineage_retention(episodes, n),
        "secret_scan": {
            "available": True,
            **secrets_report(tenant=dataset.tenant, episodes=episodes),
        },
        "tasks": len(task_ids),
        "licences": dict(sorted(licences.items())),
    }
