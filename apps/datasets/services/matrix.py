"""The harness × policy matrix (docs/datasets.md "Harness × policy matrix").

S(π, H) is computed on paired tasks only (tasks with at least one valid episode in every
cell) as the mean over those tasks of each task's success rate on its valid episodes:
the task is the unit, so ten rollouts of one task weigh as one task. Confidence
intervals come from a cluster bootstrap that resamples tasks (seeded: the same query
gives the same interval)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from apps.core.errors import ValidationFailed
from apps.tenancy.models import Tenant
from apps.trajectories import selectors as episode_selectors
from apps.trajectories.models import INVALID_CLASSES, EpisodeStatus, FailureClass

POLICY_FIELDS = ("policy_version", "model", "model_version")
MAX_CELLS = 16


@dataclass
class _TaskCell:
    n: int = 0
    valid: int = 0
    successes: int = 0

    @property
    def rate(self) -> float:
        return self.successes / self.valid


@dataclass
class _Cell:
    tasks: dict[str, _TaskCell] = field(default_factory=dict)


def _names(raw: str, what: str) -> list[str]:
    names = [x for x in (raw or "").split(",") if x]
    if not names:
        raise ValidationFailed(f"{what} is a comma-separated list", field=what)
    if len(names) != len(set(names)):
        raise ValidationFailed(f"{what} names one twice", field=what)
    return names


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _percentile(sorted_values: list[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def _s(cell: _Cell, tasks: list[str]) -> float:
    return sum(cell.tasks[t].rate for t in tasks) / len(tasks)


def episode_matrix(
    *,
    tenant: Tenant,
    policies: str,
    harnesses: str,
    tasks: str = "",
    policy_field: str = "policy_version",
    filters: dict[str, str] | None = None,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    pols, hars = _names(policies, "policies"), _names(harnesses, "harnesses")
    if policy_field not in POLICY_FIELDS:
        raise ValidationFailed(
            f"policy_field is one of {', '.join(POLICY_FIELDS)}", field="policy_field"
        )
    if len(pols) * len(hars) > MAX_CELLS:
        raise ValidationFailed(f"at most {MAX_CELLS} cells", field="policies")
    if not 0 <= resamples <= 10_000:
        raise ValidationFailed("bootstrap is 0–10000 resamples", field="bootstrap")
    qs = (
        episode_selectors.episode_list(tenant=tenant, filters=filters or {})
        .filter(status=EpisodeStatus.CLOSED, harness__in=hars, **{f"{policy_field}__in": pols})
        .order_by()
    )
    wanted_tasks = [t for t in tasks.split(",") if t] if tasks else []
    if wanted_tasks:
        qs = qs.filter(task_id__in=wanted_tasks)
    cells: dict[tuple[str, str], _Cell] = {(p, h): _Cell() for p in pols for h in hars}
    for pol, har, task_id, cls in qs.values_list(
        policy_field, "harness", "task_id", "failure_class"
    ):
        cell = cells[(pol, har)]
        tc = cell.tasks.setdefault(task_id, _TaskCell())
        tc.n += 1
        if (cls or FailureClass.UNDETERMINED) not in INVALID_CLASSES:
            tc.valid += 1
            tc.successes += cls == FailureClass.SUCCESS
    # budgets (tokens, wall time, steps per episode) over the paired tasks' episodes
    paired = sorted(
        set.intersection(
            *({t for t, tc in cell.tasks.items() if tc.valid > 0} for cell in cells.values())
        )
    )
    budgets: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(
        lambda: {"tokens": [], "wall_s": [], "steps": []}
    )
    if paired:
        for pol, har, started, ended, resources in qs.filter(task_id__in=paired).values_list(
            policy_field, "harness", "started_at", "ended_at", "resources"
        ):
            res = resources if isinstance(resources, dict) else {}
            b = budgets[(pol, har)]
            b["tokens"].append(float((res.get("tokens_in") or 0) + (res.get("tokens_out") or 0)))
            if started and ended:
                b["wall_s"].append((ended - started).total_seconds())
            b["steps"].append(float(res.get("steps") or 0))

    rng = random.Random(seed)
    boot: dict[str, list[float]] = defaultdict(list)
    two_by_two = len(pols) == 2 and len(hars) == 2
    if paired and resamples:
        for _ in range(resamples):
            sample = [paired[rng.randrange(len(paired))] for _ in paired]
            s = {k: _s(c, sample) for k, c in cells.items()}
            for (p, h), v in s.items():
                boot[f"{p}|{h}"].append(v)
            for h in hars:
                for p in pols[1:]:
                    boot[f"policy|{h}|{p}"].append(s[(p, h)] - s[(pols[0], h)])
            if two_by_two:
                (p0, p1), (ha, hb) = pols, hars
                boot["interaction"].append(
                    (s[(p1, hb)] - s[(p0, hb)]) - (s[(p1, ha)] - s[(p0, ha)])
                )

    def ci(name: str) -> list[float] | None:
        values = sorted(boot.get(name, []))
        return [_percentile(values, 0.025), _percentile(values, 0.975)] if values else None

    out_cells = []
    s_point: dict[tuple[str, str], float] = {}
    for (p, h), cell in cells.items():
        on_paired = [cell.tasks[t] for t in paired]
        n = sum(tc.n for tc in on_paired)
        valid = sum(tc.valid for tc in on_paired)
        successes = sum(tc.successes for tc in on_paired)
        s_value = _s(cell, paired) if paired else None
        if s_value is not None:
            s_point[(p, h)] = s_value
        b = budgets[(p, h)]
        out_cells.append(
            {
                "policy": p,
                "harness": h,
                "tasks": len(paired),
                "n": n,
                "valid": valid,
                "eta": valid / n if n else None,
                "successes": successes,
                "success_valid": successes / valid if valid else None,
                "S": s_value,
                "ci95": ci(f"{p}|{h}"),
                "tokens_per_episode": _mean(b["tokens"]),
                "wall_s_per_episode": _mean(b["wall_s"]),
                "steps_per_episode": _mean(b["steps"]),
                "tasks_unpaired": len(cell.tasks) - len(paired),
            }
        )
    comparisons = []
    for h in hars:
        for p in pols[1:]:
            base, new = cells[(pols[0], h)], cells[(p, h)]
            deltas = [new.tasks[t].rate - base.tasks[t].rate for t in paired]
            comparisons.append(
                {
                    "harness": h,
                    "from": pols[0],
                    "to": p,
                    "delta": (s_point[(p, h)] - s_point[(pols[0], h)]) if paired else None,
                    "ci95": ci(f"policy|{h}|{p}"),
                    "improved": sum(1 for d in deltas if d > 0),
                    "regressed": sum(1 for d in deltas if d < 0),
                    "unchanged": sum(1 for d in deltas if d == 0),
                }
            )
    interaction = None
    if two_by_two and paired:
        (p0, p1), (ha, hb) = pols, hars
        interaction = {
            "delta_int": (s_point[(p1, hb)] - s_point[(p0, hb)])
            - (s_point[(p1, ha)] - s_point[(p0, ha)]),
            "ci95": ci("interaction"),
            "formula": f"(S[{p1},{hb}] - S[{p0},{hb}]) - (S[{p1},{ha}] - S[{p0},{ha}])",
        }
    all_tasks = set().union(*(set(c.tasks) for c in cells.values()))
    return {
        "policies": pols,
        "harnesses": hars,
        "policy_field": policy_field,
        "paired_tasks": paired,
        "unpaired_tasks": sorted(all_tasks - set(paired)),
        "cells": out_cells,
        "comparisons": comparisons,
        "interaction": interaction,
        "bootstrap": {"resamples": resamples, "seed": seed, "unit": "task"},
    }
