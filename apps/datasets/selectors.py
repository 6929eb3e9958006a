"""Tenant-scoped reads: difficulty (single and bulk), health, the quarantine list."""

from __future__ import annotations

import json
from typing import Any

from django.db import connection

from apps.core.errors import NotFound
from apps.datasets.models import (
    DifficultyCounts,
    ReferenceRun,
    Task,
    TaskDifficulty,
    TaskHealth,
)
from apps.datasets.services.difficulty import Prior, decay_weights
from apps.datasets.services.reference_check import reference_summary
from apps.datasets.services.tasks import reference_as_dict
from apps.tenancy.models import Tenant

MAX_BULK_IDS = 20_000
ID_SEPARATOR = "\x1f"  # refused inside a task id by the bulk views


# One statement builds the whole answer in Postgres, one short array per (task, family),
# each kept serialised on its row as the counts change (built here only for a prior
# other than the one it was written with): nested objects for 10,000 tasks were ~3 MB
# and took ~10× longer.
_BULK_SQL = """
WITH w AS (SELECT unnest(string_to_array(%(ids)s, chr(31))) AS task_id),
d AS (
    SELECT task_id, family, version, s_eff, f_eff, quarantine, row_json, alpha0, beta0
    FROM datasets_taskdifficulty
    WHERE tenant_id = %(tenant)s
      AND (%(family)s = '' OR family = %(family)s)
      AND (%(every)s OR task_id IN (SELECT task_id FROM w))
)
SELECT
    '[' || coalesce((SELECT string_agg(
        CASE WHEN alpha0 = %(a0)s AND beta0 = %(b0)s AND row_json <> '' THEN row_json
        ELSE json_build_array(
            task_id, family, (s_eff + %(a0)s) / (s_eff + f_eff + %(a0)s + %(b0)s),
            s_eff, f_eff, version, quarantine)::text END, ',') FROM d), '') || ']',
    (SELECT coalesce(json_object_agg(h.task_id, (
        SELECT json_agg(fact ->> 'rule') FROM jsonb_array_elements(h.evidence) fact
     )), '{}'::json)
     FROM datasets_taskhealth h
     WHERE h.tenant_id = %(tenant)s AND h.quarantine
       AND h.task_id IN (SELECT task_id FROM d))::text,
    CASE WHEN %(every)s THEN NULL ELSE (
        SELECT coalesce(json_agg(DISTINCT task_id ORDER BY task_id), '[]'::json)
        FROM w WHERE task_id NOT IN (SELECT task_id FROM d)
    ) END::text
"""
BULK_COLUMNS = ["task_id", "family", "mean", "s_eff", "f_eff", "version", "quarantine"]


def difficulty_bulk_json(
    *, tenant: Tenant, ids: list[str] | None, prior: Prior, family: str | None = None
) -> str:
    """The bulk answer, already serialised, one row per (task, policy family):
    ``{"alpha0", "beta0", "columns": BULK_COLUMNS, "rows": [[...], ...], "quarantine":
    {task: [rule, ...]}, "unknown": [...]}`` (``unknown``: asked-for ids with no
    aggregate, only when ``ids`` were given). ``ids`` None: every task."""
    with connection.cursor() as cursor:
        cursor.execute(
            _BULK_SQL,
            {
                "tenant": tenant.pk,
                "every": ids is None,
                # one text parameter split in SQL: a 10,000-element array parameter
                # cost more to adapt than the query took to run
                "ids": ID_SEPARATOR.join(ids or []),
                "family": family or "",
                "a0": float(prior.alpha0),
                "b0": float(prior.beta0),
            },
        )
        rows, quarantine, unknown = cursor.fetchone()
    head = json.dumps({"alpha0": prior.alpha0, "beta0": prior.beta0, "columns": BULK_COLUMNS})
    tail = "" if unknown is None else f',"unknown":{unknown}'
    return f'{head[:-1]},"rows":{rows},"quarantine":{quarantine}{tail}}}'


def difficulty_bulk(
    *, tenant: Tenant, ids: list[str] | None, prior: Prior, family: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(
        difficulty_bulk_json(tenant=tenant, ids=ids, prior=prior, family=family)
    )
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
    """Quarantined tasks with their evidence; a verifier-suspect one also carries the
    reference run that decided it (``reference_run``)."""
    rows = list(TaskHealth.objects.filter(tenant=tenant, quarantine=True).order_by("task_id"))
    runs: dict[str, ReferenceRun] = {}
    suspect = [h.task_id for h in rows if h.verifier_suspect]
    for run in (
        ReferenceRun.objects.filter(tenant=tenant, task_id__in=suspect, status="done")
        .select_related("episode", "initial_episode")
        .order_by("task_id", "-recorded_at", "-id")
    ):
        runs.setdefault(run.task_id, run)
    return [
        {
            "task_id": h.task_id,
            "verifier_suspect": h.verifier_suspect,
            "evidence": h.evidence,
            "reference_run": reference_as_dict(runs[h.task_id]) if h.task_id in runs else None,
            "updated_at": h.updated_at.isoformat(),
        }
        for h in rows
    ]


def task_as_dict(task: Task) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "metadata": task.metadata,
        "licence": task.licence,
        "reference": reference_summary(task.reference),
        "created_at": task.created_at.isoformat(),
        "updated_at": task.updated_at.isoformat(),
    }
