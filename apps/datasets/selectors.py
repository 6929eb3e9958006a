"""Tenant-scoped reads: difficulty (single and bulk), health, the quarantine list."""

from __future__ import annotations

from typing import Any

from apps.billing.models import Tenant
from apps.datasets.models import (
    DifficultyCounts,
    ReferenceRun,
    Task,
    TaskDifficulty,
    TaskHealth,
)
from apps.datasets.services.difficulty import Prior, decay_weights
from apps.datasets.services.tasks import reference_as_dict
from controlplane.errors import NotFound

MAX_BULK_IDS = 20_000


def difficulty_bulk(
    *, tenant: Tenant, ids: list[str] | None, prior: Prior, family: str | None = None
) -> dict[str, Any]:
    """One indexed read of the maintained aggregate. ``ids`` None: every task."""
    qs = TaskDifficulty.objects.filter(tenant=tenant)
    if ids is not None:
        qs = qs.filter(task_id__in=ids)
    if family:
        qs = qs.filter(family=family)
    tasks: dict[str, dict[str, Any]] = {}
    a0, b0 = prior.alpha0, prior.beta0
    for task_id, fam, version, s_eff, f_eff, s, f, infra, quarantine in qs.values_list(
        "task_id",
        "family",
        "version",
        "s_eff",
        "f_eff",
        "successes",
        "failures",
        "infra",
        "quarantine",
    ):
        entry = tasks.get(task_id)
        if entry is None:
            entry = tasks[task_id] = {"quarantine": quarantine, "families": {}}
        entry["families"][fam] = {
            "mean": (s_eff + a0) / (s_eff + f_eff + a0 + b0),
            "s_eff": s_eff,
            "f_eff": f_eff,
            "successes": s,
            "failures": f,
            "infra": infra,
            "version": version,
        }
    quarantined = [t for t, e in tasks.items() if e["quarantine"]]
    if quarantined:
        for task_id, evidence in TaskHealth.objects.filter(
            tenant=tenant, task_id__in=quarantined
        ).values_list("task_id", "evidence"):
            tasks[task_id]["quarantine_rules"] = [fact.get("rule") for fact in evidence]
    body: dict[str, Any] = {
        "alpha0": a0,
        "beta0": b0,
        "tasks": tasks,
    }
    if ids is not None:
        body["unknown"] = sorted(set(ids) - set(tasks))
    return body


def task_difficulty(*, tenant: Tenant, task_id: str, prior: Prior) -> dict[str, Any]:
    counts = list(
        DifficultyCounts.objects.filter(tenant=tenant, task_id=task_id).order_by(
            "family", "first_seen", "version"
        )
    )
    health = TaskHealth.objects.filter(tenant=tenant, task_id=task_id).first()
    registered = Task.objects.filter(tenant=tenant, task_id=task_id).exists()
    if not counts and health is None and not registered:
        raise NotFound(f"no task {task_id!r}", code="task_not_found")
    summaries = {
        row.family: row for row in TaskDifficulty.objects.filter(tenant=tenant, task_id=task_id)
    }
    families: dict[str, Any] = {}
    for fam in sorted({r.family for r in counts}):
        rows = [
            r
            for r in counts
            if r.family == fam and (r.successes or r.failures or r.infra or r.other)
        ]
        summary = summaries.get(fam)
        if summary is None or not rows:
            continue
        weights = decay_weights(len(rows), float(_decay()))
        lo, hi = prior.interval(summary.s_eff, summary.f_eff)
        families[fam] = {
            "mean": prior.mean(summary.s_eff, summary.f_eff),
            "interval": [lo, hi],
            "s_eff": summary.s_eff,
            "f_eff": summary.f_eff,
            "successes": summary.successes,
            "failures": summary.failures,
            "infra": summary.infra,
            "other": summary.other,
            "version": summary.version,
            "versions": [
                {
                    "version": r.version,
                    "weight": w,
                    "successes": r.successes,
                    "failures": r.failures,
                    "infra": r.infra,
                    "other": r.other,
                    "first_seen": r.first_seen.isoformat(),
                }
                for r, w in zip(rows, weights, strict=True)
            ],
        }
    references = [
        reference_as_dict(r)
        for r in ReferenceRun.objects.filter(tenant=tenant, task_id=task_id)
        .select_related("episode", "initial_episode")
        .order_by("-recorded_at", "-id")
    ]
    return {
        "task_id": task_id,
        "alpha0": prior.alpha0,
        "beta0": prior.beta0,
        "decay": float(_decay()),
        "families": families,
        "quarantine": bool(health and health.quarantine),
        "verifier_suspect": bool(health and health.verifier_suspect),
        "evidence": health.evidence if health else [],
        "reference_runs": references,
    }


def _decay() -> float:
    from django.conf import settings

    return float(settings.HEDGEROW_DIFFICULTY_DECAY)


def quarantine_list(*, tenant: Tenant) -> list[dict[str, Any]]:
    return [
        {
            "task_id": h.task_id,
            "verifier_suspect": h.verifier_suspect,
            "evidence": h.evidence,
            "updated_at": h.updated_at.isoformat(),
        }
        for h in TaskHealth.objects.filter(tenant=tenant, quarantine=True).order_by("task_id")
    ]


def task_as_dict(task: Task) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "metadata": task.metadata,
        "licence": task.licence,
        "created_at": task.created_at.isoformat(),
        "updated_at": task.updated_at.isoformat(),
    }
