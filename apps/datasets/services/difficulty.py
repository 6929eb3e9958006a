"""Per (task, policy family) Beta–Bernoulli difficulty, maintained incrementally, and
the task's health (broken vs hard). docs/datasets.md "Difficulty".

Every closed episode contributes one outcome (``EpisodeContribution``): ``success``
(class success) or ``failure`` (class task) count towards the posterior; ``infra``
(startup, environment, verifier, observation) and ``other`` (undetermined, inference:
no verdict on the task) are kept for the health rules only. A relabel or a
re-attribution moves the episode's one contribution; it never adds a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Least
from django.utils import timezone

from apps.datasets.models import (
    DifficultyCounts,
    EpisodeContribution,
    ReferenceRun,
    TaskDifficulty,
    TaskHealth,
)
from apps.tenancy.models import Tenant
from apps.trajectories.models import Episode, EpisodeStatus, FailureClass

INFRA_CLASSES = frozenset(
    {
        FailureClass.STARTUP,
        FailureClass.ENVIRONMENT,
        FailureClass.VERIFIER,
        FailureClass.OBSERVATION,
    }
)
OUTCOME_FIELD = {
    "success": "successes",
    "failure": "failures",
    "infra": "infra",
    "other": "other",
}
# "Failures are mostly infra": more than this share of a task's non-successes are infra
# classes, over at least this many infra episodes.
INFRA_SHARE = 0.5
INFRA_MIN = 3
UNKNOWN = "unknown"


def outcome_of(failure_class: str) -> str:
    if failure_class == FailureClass.SUCCESS:
        return "success"
    if failure_class == FailureClass.TASK:
        return "failure"
    if failure_class in INFRA_CLASSES:
        return "infra"
    return "other"


def family_of(episode: Episode) -> tuple[str, str]:
    """(policy family, policy version): the model, and the checkpoint within it."""
    return (
        episode.model or UNKNOWN,
        episode.policy_version or episode.model_version or UNKNOWN,
    )


def _bump(
    tenant_id: Any,
    task_id: str,
    family: str,
    version: str,
    outcome: str,
    delta: int,
    at: datetime,
) -> None:
    row, _ = DifficultyCounts.objects.get_or_create(
        tenant_id=tenant_id,
        task_id=task_id,
        family=family,
        version=version,
        defaults={"first_seen": at},
    )
    field = OUTCOME_FIELD[outcome]
    DifficultyCounts.objects.filter(pk=row.pk).update(
        **{field: F(field) + delta}, first_seen=Least(F("first_seen"), at)
    )


def episode_counted(episode: Episode) -> None:
    """Brings the aggregates in line with the episode as it is now (called on every
    save of an episode and before its deletion, with ``deleted=True`` below)."""
    _recount(episode, deleted=False)


def episode_uncounted(episode: Episode) -> None:
    _recount(episode, deleted=True)


def _recount(episode: Episode, *, deleted: bool) -> None:
    new: tuple[str, str, str, str] | None = None
    if not deleted and episode.status == EpisodeStatus.CLOSED:
        family, version = family_of(episode)
        new = (episode.task_id, family, version, outcome_of(episode.failure_class))
    with transaction.atomic():
        old = EpisodeContribution.objects.select_for_update().filter(episode_id=episode.pk).first()
        before = None if old is None else (old.task_id, old.family, old.version, old.outcome)
        if before == new:
            return
        touched: set[tuple[str, str]] = set()
        if old is not None:
            _bump(
                episode.tenant_id,
                old.task_id,
                old.family,
                old.version,
                old.outcome,
                -1,
                old.started_at,
            )
            touched.add((old.task_id, old.family))
        if new is None:
            EpisodeContribution.objects.filter(episode_id=episode.pk).delete()
        else:
            task_id, family, version, outcome = new
            _bump(episode.tenant_id, task_id, family, version, outcome, 1, episode.started_at)
            EpisodeContribution.objects.update_or_create(
                episode_id=episode.pk,
                defaults={
                    "tenant_id": episode.tenant_id,
                    "task_id": task_id,
                    "family": family,
                    "version": version,
                    "outcome": outcome,
                    "started_at": episode.started_at,
                },
            )
            touched.add((task_id, family))
        for task_id, family in sorted(touched):
            summary_refresh(tenant_id=episode.tenant_id, task_id=task_id, family=family)
        for task_id in sorted({t for t, _ in touched}):
            health_refresh(tenant_id=episode.tenant_id, task_id=task_id)


def decay_weights(n_versions: int, decay: float) -> list[float]:
    """Weights of a family's versions, oldest first: the newest counts fully, each
    version before it ``decay`` times less than the one after it."""
    return [decay ** (n_versions - 1 - i) for i in range(n_versions)]


def summary_refresh(*, tenant_id: Any, task_id: str, family: str) -> None:
    rows = list(
        DifficultyCounts.objects.filter(tenant_id=tenant_id, task_id=task_id, family=family)
        .exclude(successes=0, failures=0, infra=0, other=0)
        .order_by("first_seen", "version")
    )
    if not rows:
        TaskDifficulty.objects.filter(tenant_id=tenant_id, task_id=task_id, family=family).delete()
        return
    weights = decay_weights(len(rows), float(settings.HEDGEROW_DIFFICULTY_DECAY))
    health = TaskHealth.objects.filter(tenant_id=tenant_id, task_id=task_id).first()
    s_eff = sum(w * r.successes for w, r in zip(weights, rows, strict=True))
    f_eff = sum(w * r.failures for w, r in zip(weights, rows, strict=True))
    quarantine = bool(health and health.quarantine)
    prior = Prior.default()
    TaskDifficulty.objects.update_or_create(
        tenant_id=tenant_id,
        task_id=task_id,
        family=family,
        defaults={
            "version": rows[-1].version,
            "s_eff": s_eff,
            "f_eff": f_eff,
            "successes": sum(r.successes for r in rows),
            "failures": sum(r.failures for r in rows),
            "infra": sum(r.infra for r in rows),
            "other": sum(r.other for r in rows),
            "quarantine": quarantine,
            "row_json": bulk_row(
                task_id, family, prior, s_eff, f_eff, rows[-1].version, quarantine
            ),
            "alpha0": prior.alpha0,
            "beta0": prior.beta0,
            "updated_at": timezone.now(),
        },
    )


def bulk_row(
    task_id: str,
    family: str,
    prior: Prior,
    s_eff: float,
    f_eff: float,
    version: str,
    quarantine: bool,
) -> str:
    """One row of the bulk answer (selectors.BULK_COLUMNS), serialised."""
    return json.dumps(
        [task_id, family, prior.mean(s_eff, f_eff), s_eff, f_eff, version, quarantine],
        separators=(",", ":"),
    )


def _check_facts(detail: dict[str, Any], which: str) -> dict[str, Any]:
    """What a check Hedgerow ran itself adds to a fact: the run's exit, why it decided,
    its per-test summary and the (deleted) sandbox it ran in."""
    ran = (detail or {}).get(which)
    if not isinstance(ran, dict):
        return {}
    facts = {k: ran[k] for k in ("exit_code", "why", "summary", "duration_s") if k in ran}
    if detail.get("sandbox_id"):
        facts["sandbox_id"] = detail["sandbox_id"]
    return facts


def _reference_facts(tenant_id: Any, task_id: str) -> list[dict[str, Any]]:
    # a check still running, or one that broke on its own (infra), is no evidence
    run = (
        ReferenceRun.objects.filter(tenant_id=tenant_id, task_id=task_id, status="done")
        .order_by("-recorded_at", "-id")
        .select_related("episode", "initial_episode")
        .first()
    )
    if run is None:
        return []
    key = {
        "task_version": run.task_version,
        "image_digest": run.image_digest,
        "verifier_version": run.verifier_version,
        "source": run.source,
    }
    facts: list[dict[str, Any]] = []
    if run.reference_outcome != "pass":
        facts.append(
            {
                "rule": "verifier_fails_reference",
                "detail": f"the verifier gave {run.reference_outcome} on the reference solution",
                "outcome": run.reference_outcome,
                "episode_id": run.episode.episode_id if run.episode else None,
                **_check_facts(run.detail, "reference"),
                **key,
            }
        )
    if run.initial_outcome == "pass":
        facts.append(
            {
                "rule": "verifier_passes_initial_state",
                "detail": "the verifier passed the unmodified initial state: it cannot tell "
                "a solution from no attempt",
                "episode_id": run.initial_episode.episode_id if run.initial_episode else None,
                **_check_facts(run.detail, "initial"),
                **key,
            }
        )
    return facts


def health_refresh(*, tenant_id: Any, task_id: str) -> TaskHealth:
    """Decides broken vs hard for a task and copies the flag onto its difficulty rows.

    Quarantined when the verifier fails the task's reference solution (or passes its
    initial state): ``verifier_suspect``; or when its failures are mostly infra classes
    (more than ``INFRA_SHARE`` of the non-successes, at least ``INFRA_MIN``)."""
    counts = DifficultyCounts.objects.filter(tenant_id=tenant_id, task_id=task_id)
    per_family: dict[str, list[int]] = {}
    for row in counts:
        totals = per_family.setdefault(row.family, [0, 0, 0])
        totals[0] += row.successes
        totals[1] += row.failures
        totals[2] += row.infra
    f = sum(t[1] for t in per_family.values())
    infra = sum(t[2] for t in per_family.values())
    evidence = _reference_facts(tenant_id, task_id)
    suspect = bool(evidence)
    tried = {fam: t for fam, t in per_family.items() if t[0] + t[1] > 0}
    if tried and all(t[0] == 0 for t in tried.values()):
        evidence.append(
            {
                "rule": "every_policy_fails",
                "detail": f"no success in {f} valid episodes of {len(tried)} policy families",
                "families": sorted(tried),
                "failures": f,
            }
        )
    mostly_infra = infra >= INFRA_MIN and infra / (infra + f) > INFRA_SHARE
    if mostly_infra:
        evidence.append(
            {
                "rule": "mostly_infra_failures",
                "detail": f"{infra} of {infra + f} failed episodes are infra classes",
                "infra": infra,
                "failures": f,
                "share": round(infra / (infra + f), 4),
            }
        )
    quarantine = suspect or mostly_infra
    health, _ = TaskHealth.objects.update_or_create(
        tenant_id=tenant_id,
        task_id=task_id,
        defaults={
            "quarantine": quarantine,
            "verifier_suspect": suspect,
            "evidence": evidence,
            "updated_at": timezone.now(),
        },
    )
    for served in TaskDifficulty.objects.filter(tenant_id=tenant_id, task_id=task_id).exclude(
        quarantine=quarantine
    ):
        served.quarantine = quarantine
        served.row_json = bulk_row(
            served.task_id,
            served.family,
            Prior(served.alpha0, served.beta0),
            served.s_eff,
            served.f_eff,
            served.version,
            quarantine,
        )
        served.save(update_fields=["quarantine", "row_json"])
    return health


@dataclass(frozen=True)
class Prior:
    alpha0: float
    beta0: float

    @classmethod
    def default(cls) -> Prior:
        return cls(
            float(settings.HEDGEROW_DIFFICULTY_ALPHA0), float(settings.HEDGEROW_DIFFICULTY_BETA0)
        )

    def mean(self, s: float, f: float) -> float:
        return (s + self.alpha0) / (s + f + self.alpha0 + self.beta0)

    def interval(self, s: float, f: float) -> tuple[float, float]:
        """The posterior's mean ± 2 standard deviations, clipped to [0, 1]."""
        a, b = s + self.alpha0, f + self.beta0
        sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
        m = a / (a + b)
        return (max(0.0, m - 2 * sd), min(1.0, m + 2 * sd))


def difficulty_rebuild(*, tenant: Tenant | None = None) -> int:
    """Recomputes every aggregate from the episodes (after an upgrade that added this
    app, or a change of the decay). Returns how many episodes were counted."""
    episodes = Episode.objects.filter(status=EpisodeStatus.CLOSED)
    scope: dict[str, Any] = {} if tenant is None else {"tenant": tenant}
    with transaction.atomic():
        EpisodeContribution.objects.filter(**scope).delete()
        DifficultyCounts.objects.filter(**scope).delete()
        TaskDifficulty.objects.filter(**scope).delete()
        if tenant is not None:
            episodes = episodes.filter(tenant=tenant)
        n = 0
        for episode in episodes.iterator():
            episode_counted(episode)
            n += 1
        health_tasks = TaskHealth.objects.filter(**scope).values_list("tenant_id", "task_id")
        for tenant_id, task_id in list(health_tasks):
            health_refresh(tenant_id=tenant_id, task_id=task_id)
    return n
