"""Training data built from episodes: the task registry (metadata the splits group by,
licences, reference runs), datasets with their split membership, and the maintained
difficulty aggregates (docs/datasets.md).

Episodes stay in ``apps.trajectories``; this app only reads them and keeps its own
rows keyed by the tenant and the task id the episodes carry.
"""

from __future__ import annotations

import secrets

from django.db import models
from django.utils import timezone

from apps.tenancy.models import Tenant
from apps.trajectories.models import Episode


def new_dataset_id() -> str:
    return f"ds-{secrets.token_hex(8)}"


class Task(models.Model):
    """What a team knows about a task beyond its id: the metadata leakage-aware splits
    group by (``repo``, ``base_commit``, ``affected_files``, ``failing_tests``,
    ``created_at``, ``fix_merged_at``) and its licence. Registered with
    ``PUT /api/v1/tasks/{task_id}``; episodes do not need one."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    task_id = models.CharField(max_length=200)
    metadata = models.JSONField(default=dict, blank=True)
    licence = models.CharField(max_length=100, blank=True)
    # The reference check's input (services/reference_check.py): image, task version,
    # verifier (command, kind, version, report path, timeout) and the reference solution
    # (files or a patch, bounded). Empty: no check.
    reference = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "task_id"], name="uniq_dataset_task")
        ]


class ReferenceRun(models.Model):
    """The verifier run on a task's reference solution (and on its initial state), once
    per (task version, image digest, verifier version): the evidence for "broken, not
    hard". ``episode`` is the recorded run when the client ran it as an episode (its
    outcome then comes from the control plane's attribution, not the client)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    task_id = models.CharField(max_length=200)
    task_version = models.CharField(max_length=100, blank=True)
    image_digest = models.CharField(max_length=100, blank=True)
    verifier_version = models.CharField(max_length=100, blank=True)
    reference_outcome = models.CharField(max_length=16)  # pass | fail | error | timeout
    initial_outcome = models.CharField(max_length=16, blank=True)  # the unmodified state
    source = models.CharField(max_length=16)  # episode | client | check
    status = models.CharField(max_length=16, default="done")  # queued|running|done|error
    episode = models.ForeignKey(
        Episode, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    initial_episode = models.ForeignKey(
        Episode, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    detail = models.JSONField(default=dict, blank=True)
    recorded_by = models.CharField(max_length=128, blank=True)
    recorded_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "task_id", "task_version", "image_digest", "verifier_version"],
                name="uniq_reference_run_key",
            )
        ]


class Split(models.TextChoices):
    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"


class Dataset(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    dataset_id = models.CharField(max_length=64, default=new_dataset_id)
    name = models.CharField(max_length=200, blank=True)
    # What was asked: filters, group_by, fractions, seed, temporal cut-offs, valid_only.
    definition = models.JSONField(default=dict)
    group_by = models.CharField(max_length=32)
    # Per split: episodes, groups, tasks, by_class; and what was left out and why.
    counts = models.JSONField(default=dict)
    excluded = models.JSONField(default=dict, blank=True)
    # No group, task or key value in two splits (checked on the stored membership).
    leak_check = models.JSONField(default=dict)
    created_by = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "dataset_id"], name="uniq_dataset_id")
        ]
        ordering = ["-created_at", "-id"]


class DatasetEpisode(models.Model):
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="members")
    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="+")
    split = models.CharField(max_length=16, choices=Split.choices)
    group = models.CharField(max_length=200)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["dataset", "episode"], name="uniq_dataset_episode")
        ]
        indexes = [models.Index(fields=["dataset", "split"], name="dataset_member_split")]


class EpisodeContribution(models.Model):
    """What one closed episode adds to the difficulty counts, so a relabel or a
    re-attribution moves its count instead of adding it twice."""

    episode = models.OneToOneField(
        Episode, on_delete=models.CASCADE, primary_key=True, related_name="+"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    task_id = models.CharField(max_length=200)
    family = models.CharField(max_length=200)
    version = models.CharField(max_length=200)
    outcome = models.CharField(max_length=8)  # success | failure | infra | other
    started_at = models.DateTimeField()


class DifficultyCounts(models.Model):
    """Counts per (task, policy family, policy version), maintained incrementally."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    task_id = models.CharField(max_length=200)
    family = models.CharField(max_length=200)
    version = models.CharField(max_length=200)
    successes = models.IntegerField(default=0)
    failures = models.IntegerField(default=0)
    infra = models.IntegerField(default=0)
    other = models.IntegerField(default=0)
    first_seen = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "task_id", "family", "version"], name="uniq_difficulty_counts"
            )
        ]


class TaskDifficulty(models.Model):
    """The served aggregate per (task, policy family): decayed counts and the task's
    quarantine flag, read by ``GET /api/v1/tasks/difficulty`` with one indexed query."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    task_id = models.CharField(max_length=200)
    family = models.CharField(max_length=200)
    version = models.CharField(max_length=200)  # the current (latest) policy version
    s_eff = models.FloatField(default=0)
    f_eff = models.FloatField(default=0)
    successes = models.IntegerField(default=0)  # raw, every version
    failures = models.IntegerField(default=0)
    infra = models.IntegerField(default=0)
    other = models.IntegerField(default=0)
    quarantine = models.BooleanField(default=False)
    # The bulk answer's row for this (task, family), serialised when the counts change:
    # [task_id, family, mean, s_eff, f_eff, version, quarantine], the mean under the
    # prior (alpha0, beta0) it was written with. A read with another prior builds it.
    row_json = models.TextField(default="")
    alpha0 = models.FloatField(default=1.0)
    beta0 = models.FloatField(default=1.0)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "task_id", "family"], name="uniq_task_difficulty"
            )
        ]


class TaskHealth(models.Model):
    """Broken vs hard, per task: ``quarantine`` with the evidence that decided it."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    task_id = models.CharField(max_length=200)
    quarantine = models.BooleanField(default=False)
    verifier_suspect = models.BooleanField(default=False)
    evidence = models.JSONField(default=list, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "task_id"], name="uniq_task_health")
        ]
