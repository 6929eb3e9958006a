"""The task registry (metadata, licence) and reference runs (verifier health)."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.core.errors import Conflict, NotFound, ValidationFailed
from apps.datasets.models import ReferenceRun, Task
from apps.datasets.services.difficulty import health_refresh
from apps.datasets.services.reference_check import reference_spec_check
from apps.tenancy.models import Tenant
from apps.trajectories.models import Episode, EpisodeStatus, FailureClass

LIST_KEYS = ("affected_files", "failing_tests")
TEXT_KEYS = ("repo", "base_commit")
TIME_KEYS = ("created_at", "fix_merged_at")
OUTCOMES = ("pass", "fail", "error", "timeout")


def metadata_check(metadata: Any) -> dict[str, Any]:
    """The keys splits and cut-offs read are typed; anything else is kept as given."""
    if not isinstance(metadata, dict):
        raise ValidationFailed("metadata must be an object", field="metadata")
    for key in TEXT_KEYS:
        if key in metadata and not isinstance(metadata[key], str):
            raise ValidationFailed(f"{key} must be a string", field=f"metadata.{key}")
    for key in LIST_KEYS:
        value = metadata.get(key)
        if key in metadata and (
            not isinstance(value, list) or not all(isinstance(v, str) and v for v in value)
        ):
            raise ValidationFailed(
                f"{key} must be a list of non-empty strings", field=f"metadata.{key}"
            )
    for key in TIME_KEYS:
        if key in metadata and (
            not isinstance(metadata[key], str) or parse_datetime(metadata[key]) is None
        ):
            raise ValidationFailed(
                f"{key} must be an ISO 8601 time with an offset", field=f"metadata.{key}"
            )
        if key in metadata and parse_datetime(metadata[key]).tzinfo is None:  # type: ignore[union-attr]
            raise ValidationFailed(f"{key} needs a UTC offset", field=f"metadata.{key}")
    return metadata


def task_upsert(
    *, tenant: Tenant, task_id: str, metadata: Any, licence: Any, reference: Any = None
) -> tuple[Task, bool]:
    """Registers or replaces a task. ``reference`` (reference_check.reference_spec_check)
    replaces the stored one when given; omitted, the stored one stays."""
    if not task_id or len(task_id) > 200:
        raise ValidationFailed("task_id is 1–200 characters", field="task_id")
    clean = metadata_check({} if metadata is None else metadata)
    if licence is None:
        licence = ""
    if not isinstance(licence, str) or len(licence) > 100:
        raise ValidationFailed("licence is a string of at most 100 characters", field="licence")
    defaults: dict[str, Any] = {"metadata": clean, "licence": licence, "updated_at": timezone.now()}
    if reference is not None:
        defaults["reference"] = reference_spec_check(reference)
    task, created = Task.objects.update_or_create(tenant=tenant, task_id=task_id, defaults=defaults)
    return task, created


def task_get(*, tenant: Tenant, task_id: str) -> Task:
    task = Task.objects.filter(tenant=tenant, task_id=task_id).first()
    if task is None:
        raise NotFound(f"no task {task_id!r}", code="task_not_found")
    return task


def _episode_outcome(tenant: Tenant, episode_id: Any, field: str) -> tuple[str, Episode]:
    if not isinstance(episode_id, str):
        raise ValidationFailed("an episode id is a string", field=field)
    episode = Episode.objects.for_tenant(tenant).filter(episode_id=episode_id).first()
    if episode is None:
        raise NotFound(f"no episode {episode_id!r}", code="episode_not_found")
    if episode.status != EpisodeStatus.CLOSED:
        raise Conflict(f"episode {episode_id} is still open", code="episode_open", field=field)
    cls = episode.failure_class
    decisive = (episode.failure_evidence or [{}])[0]
    if cls == FailureClass.VERIFIER and decisive.get("rule") == "task_verifier_suspect":
        # the task's verifier is suspect: what it said on this run is the reference result
        cls = decisive.get("verdict_class") or cls
    if cls == FailureClass.SUCCESS:
        return "pass", episode
    if cls == FailureClass.TASK:
        return "fail", episode
    if cls == FailureClass.VERIFIER:
        return (episode.verifier_outcome if episode.verifier_outcome in OUTCOMES else "error"), (
            episode
        )
    raise Conflict(
        f"episode {episode_id} ended {cls or 'without a class'}: it says nothing about the "
        "verifier; run it again",
        code="reference_run_invalid",
        field=field,
    )


def reference_record(
    *, tenant: Tenant, task_id: str, data: dict[str, Any], actor: str
) -> ReferenceRun:
    """Records the verifier's result on the reference solution (and optionally on the
    initial state) for one (task version, image digest, verifier version); the same key
    again replaces it. An episode id beats a reported outcome: its class is the control
    plane's."""
    key: dict[str, str] = {}
    for name in ("task_version", "image_digest", "verifier_version"):
        value = data.get(name, "")
        if not isinstance(value, str) or len(value) > 100:
            raise ValidationFailed(f"{name} is a string of at most 100 characters", field=name)
        key[name] = value
    # a reported run is done as recorded (it replaces a check of the same key)
    fields: dict[str, Any] = {"detail": {}, "status": "done"}
    if data.get("reference_episode_id") is not None:
        fields["reference_outcome"], fields["episode"] = _episode_outcome(
            tenant, data["reference_episode_id"], "reference_episode_id"
        )
        fields["source"] = "episode"
    elif data.get("reference_outcome") in OUTCOMES:
        fields["reference_outcome"], fields["episode"], fields["source"] = (
            data["reference_outcome"],
            None,
            "client",
        )
    else:
        raise ValidationFailed(
            f"give reference_episode_id or reference_outcome ({', '.join(OUTCOMES)})",
            field="reference_outcome",
        )
    fields["initial_outcome"], fields["initial_episode"] = "", None
    if data.get("initial_episode_id") is not None:
        fields["initial_outcome"], fields["initial_episode"] = _episode_outcome(
            tenant, data["initial_episode_id"], "initial_episode_id"
        )
    elif data.get("initial_outcome") is not None:
        if data["initial_outcome"] not in OUTCOMES:
            raise ValidationFailed(
                f"initial_outcome is one of {', '.join(OUTCOMES)}", field="initial_outcome"
            )
        fields["initial_outcome"] = data["initial_outcome"]
    if not task_id or len(task_id) > 200:
        raise ValidationFailed("task_id is 1–200 characters", field="task_id")
    with transaction.atomic():
        run, _ = ReferenceRun.objects.update_or_create(
            tenant=tenant,
            task_id=task_id,
            task_version=key["task_version"],
            image_digest=key["image_digest"],
            verifier_version=key["verifier_version"],
            defaults={**fields, "recorded_by": actor, "recorded_at": timezone.now()},
        )
        health_refresh(tenant_id=tenant.pk, task_id=task_id)
    return run


def reference_as_dict(run: ReferenceRun) -> dict[str, Any]:
    return {
        "task_id": run.task_id,
        "task_version": run.task_version,
        "image_digest": run.image_digest,
        "verifier_version": run.verifier_version,
        "reference_outcome": run.reference_outcome,
        "initial_outcome": run.initial_outcome or None,
        "source": run.source,
        "reference_episode_id": run.episode.episode_id if run.episode else None,
        "initial_episode_id": run.initial_episode.episode_id if run.initial_episode else None,
        "status": run.status,
        "recorded_by": run.recorded_by,
        "recorded_at": run.recorded_at.isoformat(),
        # a check Hedgerow ran: per run exit code, verdict, why, per-test vector and
        # duration; the sandbox it ran in; what broke when status is error
        "detail": run.detail,
    }
