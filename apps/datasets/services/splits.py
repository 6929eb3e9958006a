"""Leakage-aware train/validation/test splits (docs/datasets.md "Splits").

Episodes are grouped so that related ones never straddle splits: every episode of a
task is in its task's group (rollouts of one task always share a split), and tasks that
share a value of the chosen key (repository + base commit, an affected file, a failing
test, an image digest) are one group (union–find: sharing any one value joins them).
Groups are then placed whole: by temporal cut-offs when given, else by a seeded
deterministic order filling each split towards its fraction.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils.dateparse import parse_datetime

from apps.core.errors import NotFound, ValidationFailed
from apps.datasets.models import Dataset, DatasetEpisode, Split, Task
from apps.tenancy.models import Tenant
from apps.trajectories import selectors as episode_selectors
from apps.trajectories.models import INVALID_CLASSES, Episode, EpisodeStatus, FailureClass

GROUP_KEYS = ("task", "repo_commit", "affected_files", "failing_tests", "image_digest")
TEMPORAL_FIELDS = ("episode_started_at", "task_created_at", "fix_merged_at")
SPLITS = [s.value for s in Split]
DEFAULT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}
MAX_EPISODES = 200_000


@dataclass
class DatasetSpec:
    name: str = ""
    filters: dict[str, str] = field(default_factory=dict)
    group_by: str = "task"
    fractions: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FRACTIONS))
    seed: int = 0
    valid_only: bool = False
    temporal: dict[str, str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "filters": self.filters,
            "group_by": self.group_by,
            "fractions": self.fractions,
            "seed": self.seed,
            "valid_only": self.valid_only,
            "temporal": self.temporal,
        }


def _spec_check(spec: DatasetSpec) -> tuple[str | None, datetime | None, datetime | None]:
    if spec.group_by not in GROUP_KEYS:
        raise ValidationFailed(f"group_by is one of {', '.join(GROUP_KEYS)}", field="group_by")
    for name, value in spec.fractions.items():
        if name not in SPLITS:
            raise ValidationFailed(f"splits are {', '.join(SPLITS)}", field=f"fractions.{name}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValidationFailed("a fraction is a number in [0, 1]", field=f"fractions.{name}")
    if abs(sum(spec.fractions.values()) - 1.0) > 1e-9:
        raise ValidationFailed("fractions must add up to 1", field="fractions")
    for name in spec.filters:
        if name not in episode_selectors.FILTER_PARAMS:
            raise ValidationFailed(
                f"filters are {', '.join(episode_selectors.FILTER_PARAMS)}",
                field=f"filters.{name}",
            )
    if spec.temporal is None:
        return None, None, None
    unknown = set(spec.temporal) - {"field", "validation_from", "test_from"}
    if unknown:
        raise ValidationFailed(
            "temporal has field, validation_from, test_from", field=f"temporal.{sorted(unknown)[0]}"
        )
    which = spec.temporal.get("field", "episode_started_at")
    if which not in TEMPORAL_FIELDS:
        raise ValidationFailed(
            f"temporal.field is one of {', '.join(TEMPORAL_FIELDS)}", field="temporal.field"
        )
    cuts: list[datetime | None] = []
    for name in ("validation_from", "test_from"):
        raw = spec.temporal.get(name)
        if raw is None:
            cuts.append(None)
            continue
        when = parse_datetime(raw) if isinstance(raw, str) else None
        if when is None or when.tzinfo is None:
            raise ValidationFailed("an ISO 8601 time with a UTC offset", field=f"temporal.{name}")
        cuts.append(when)
    validation_from, test_from = cuts
    if test_from is None:
        raise ValidationFailed("a temporal split needs test_from", field="temporal.test_from")
    if validation_from is not None and validation_from > test_from:
        raise ValidationFailed(
            "validation_from must not be after test_from", field="temporal.validation_from"
        )
    return which, validation_from, test_from


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # the smaller name is the root: group names do not depend on order
            lo, hi = sorted((ra, rb))
            self.parent[hi] = lo


def key_values(
    group_by: str, task_id: str, metadata: dict[str, Any], digests: Iterable[str]
) -> list[str]:
    """The values of the grouping key for one task; tasks sharing any value are one
    group. Empty when the task has none (it is then a group of its own)."""
    if group_by == "repo_commit":
        repo, commit = metadata.get("repo"), metadata.get("base_commit")
        return [f"repo:{repo}@{commit}"] if repo and commit else []
    if group_by == "affected_files":
        return [f"file:{f}" for f in metadata.get("affected_files") or []]
    if group_by == "failing_tests":
        return [f"test:{t}" for t in metadata.get("failing_tests") or []]
    if group_by == "image_digest":
        return [f"digest:{d}" for d in sorted(set(digests)) if d]
    return []


def _order_key(seed: int, group: str) -> str:
    return hashlib.sha256(f"{seed}:{group}".encode()).hexdigest()


def assign_by_fractions(
    sizes: dict[str, int], fractions: dict[str, float], seed: int
) -> dict[str, str]:
    """Places whole groups: in a seeded order, each group goes to the split furthest
    behind its fraction of the episodes placed so far (ties: train, validation, test)."""
    counts = {s: 0 for s in SPLITS}
    placed = 0
    out: dict[str, str] = {}
    wanted = [s for s in SPLITS if fractions.get(s, 0) > 0]
    for group in sorted(sizes, key=lambda g: _order_key(seed, g)):
        size = sizes[group]
        best = max(
            wanted,
            key=lambda s: (fractions[s] * (placed + size) - counts[s], -SPLITS.index(s)),
        )
        out[group] = best
        counts[best] += size
        placed += size
    return out


@dataclass
class _Plan:
    members: list[tuple[Episode, str, str]]  # episode, split, group
    excluded: dict[str, int]
    missing_key_tasks: int


def _plan(tenant: Tenant, spec: DatasetSpec) -> _Plan:
    which, validation_from, test_from = _spec_check(spec)
    episodes = list(
        episode_selectors.episode_list(tenant=tenant, filters=spec.filters)
        .filter(status=EpisodeStatus.CLOSED)
        .order_by("started_at", "episode_id")[: MAX_EPISODES + 1]
    )
    if len(episodes) > MAX_EPISODES:
        raise ValidationFailed(
            f"the filters match more than {MAX_EPISODES} episodes", field="filters"
        )
    excluded: Counter[str] = Counter()
    if spec.valid_only:
        kept = [
            e
            for e in episodes
            if (e.failure_class or FailureClass.UNDETERMINED) not in INVALID_CLASSES
        ]
        excluded["invalid_class"] = len(episodes) - len(kept)
        episodes = kept
    tasks = {
        t.task_id: t
        for t in Task.objects.filter(tenant=tenant, task_id__in={e.task_id for e in episodes})
    }
    digests: dict[str, set[str]] = defaultdict(set)
    for e in episodes:
        digests[e.task_id].add(e.image_digest)
    uf = _UnionFind()
    missing = 0
    for task_id in sorted(digests):
        node = f"task:{task_id}"
        uf.find(node)
        meta = tasks[task_id].metadata if task_id in tasks else {}
        values = key_values(spec.group_by, task_id, meta, digests[task_id])
        if spec.group_by != "task" and not values:
            missing += 1
        for value in values:
            uf.union(node, value)
    # A group is named by its smallest task id (its members are tasks and key values).
    group_of_root: dict[str, str] = {}
    for task_id in sorted(digests):
        group_of_root.setdefault(uf.find(f"task:{task_id}"), task_id)
    group_of = {t: group_of_root[uf.find(f"task:{t}")] for t in digests}

    split_of: dict[str, str] = {}
    sizes = Counter(group_of[e.task_id] for e in episodes)
    if which is None:
        split_of = assign_by_fractions(dict(sizes), spec.fractions, spec.seed)
    else:
        group_time: dict[str, datetime] = {}
        untimed: set[str] = set()
        for e in episodes:
            when: datetime | None
            if which == "episode_started_at":
                when = e.started_at
            else:
                meta = tasks[e.task_id].metadata if e.task_id in tasks else {}
                raw = meta.get("created_at" if which == "task_created_at" else "fix_merged_at")
                when = parse_datetime(raw) if isinstance(raw, str) else None
            g = group_of[e.task_id]
            if when is None:
                untimed.add(g)  # left out whole: where it belongs in time is unknown
            else:
                # a group is as late as its latest member: nothing later leaks into train
                group_time[g] = max(group_time.get(g, when), when)
        for g in untimed:
            group_time.pop(g, None)
        rest: dict[str, int] = {}
        for g, size in sizes.items():
            if g not in group_time:
                continue
            t = group_time[g]
            if test_from is not None and t >= test_from:
                split_of[g] = Split.TEST
            elif validation_from is not None and t >= validation_from:
                split_of[g] = Split.VALIDATION
            elif validation_from is not None:
                split_of[g] = Split.TRAIN
            else:
                rest[g] = size
        if rest:
            train_val = {s: spec.fractions.get(s, 0.0) for s in ("train", "validation")}
            total = sum(train_val.values())
            if total <= 0:
                train_val, total = {"train": 1.0, "validation": 0.0}, 1.0
            split_of.update(
                assign_by_fractions(rest, {s: v / total for s, v in train_val.items()}, spec.seed)
            )
    members: list[tuple[Episode, str, str]] = []
    for e in episodes:
        g = group_of[e.task_id]
        if g not in split_of:
            excluded["missing_time"] += 1
            continue
        members.append((e, split_of[g], g))
    return _Plan(members, dict(excluded), missing)


def leak_check(dataset: Dataset) -> dict[str, Any]:
    """Reads the stored membership back and checks that no group, no task and no value
    of the grouping key appears in two splits."""
    rows = list(
        DatasetEpisode.objects.filter(dataset=dataset).values_list(
            "split", "group", "episode__task_id", "episode__image_digest"
        )
    )
    tasks = {
        t.task_id: t.metadata
        for t in Task.objects.filter(tenant_id=dataset.tenant_id, task_id__in={r[2] for r in rows})
    }
    seen: dict[str, dict[str, set[str]]] = {"group": {}, "task": {}, "key": {}}
    for split, group, task_id, digest in rows:
        seen["group"].setdefault(group, set()).add(split)
        seen["task"].setdefault(task_id, set()).add(split)
        for value in key_values(dataset.group_by, task_id, tasks.get(task_id, {}), [digest]):
            seen["key"].setdefault(value, set()).add(split)
    straddling = {
        kind: sorted(k for k, s in values.items() if len(s) > 1) for kind, values in seen.items()
    }
    return {
        "ok": not any(straddling.values()),
        "groups_in_two_splits": len(straddling["group"]),
        "tasks_in_two_splits": len(straddling["task"]),
        "key_values_in_two_splits": len(straddling["key"]),
        "examples": [x for kind in ("group", "task", "key") for x in straddling[kind]][:10],
        "groups": len(seen["group"]),
    }


def _counts(members: list[tuple[Episode, str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for split in SPLITS:
        rows = [(e, g) for e, s, g in members if s == split]
        by_class = {cls: 0 for cls in FailureClass.values}
        for e, _ in rows:
            by_class[e.failure_class or FailureClass.UNDETERMINED] += 1
        out[split] = {
            "episodes": len(rows),
            "groups": len({g for _, g in rows}),
            "tasks": len({e.task_id for e, _ in rows}),
            "by_class": by_class,
        }
    return out


def dataset_create(*, tenant: Tenant, spec: DatasetSpec, actor: str) -> Dataset:
    plan = _plan(tenant, spec)
    if not plan.members:
        raise ValidationFailed(
            "no closed episode matches the filters", field="filters", code="empty_dataset"
        )
    excluded = dict(plan.excluded)
    if plan.missing_key_tasks:
        excluded["tasks_without_key"] = plan.missing_key_tasks
    with transaction.atomic():
        dataset = Dataset.objects.create(
            tenant=tenant,
            name=spec.name,
            definition=spec.as_dict(),
            group_by=spec.group_by,
            counts=_counts(plan.members),
            excluded=excluded,
            created_by=actor,
        )
        DatasetEpisode.objects.bulk_create(
            [
                DatasetEpisode(dataset=dataset, episode=e, split=s, group=g)
                for e, s, g in plan.members
            ],
            batch_size=2000,
        )
        dataset.leak_check = leak_check(dataset)
        dataset.save(update_fields=["leak_check"])
    return dataset


def dataset_get(*, tenant: Tenant, dataset_id: str) -> Dataset:
    dataset = Dataset.objects.filter(tenant=tenant, dataset_id=dataset_id).first()
    if dataset is None:
        raise NotFound(f"no dataset {dataset_id!r}", code="dataset_not_found")
    return dataset


def dataset_episodes(*, dataset: Dataset, split: str) -> Any:
    if split not in SPLITS:
        raise ValidationFailed(f"split is one of {', '.join(SPLITS)}", field="split")
    return Episode.objects.filter(
        pk__in=DatasetEpisode.objects.filter(dataset=dataset, split=split).values("episode_id")
    ).order_by("started_at", "episode_id")


def dataset_as_dict(dataset: Dataset) -> dict[str, Any]:
    return {
        "id": dataset.dataset_id,
        "name": dataset.name,
        "definition": dataset.definition,
        "group_by": dataset.group_by,
        "splits": dataset.counts,
        "excluded": dataset.excluded,
        "leak_check": dataset.leak_check,
        "created_by": dataset.created_by,
        "created_at": dataset.created_at.isoformat(),
    }
