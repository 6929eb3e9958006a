"""Writes for episodes: open, attach sandboxes, append steps, close (attribute + cost),
relabel."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from apps.core import jsonsafe
from apps.core.errors import Conflict, NotFound, ValidationFailed
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.exec_env import request_public
from apps.sandboxes.models import Operation, Sandbox
from apps.sandboxes.selectors import snapshot_get
from apps.sandboxes.services.egress import sandbox_dns_log
from apps.tenancy.models import Tenant
from apps.trajectories import provenance
from apps.trajectories.cost import episode_sandbox_cost, sharing_episodes
from apps.trajectories.models import (
    TERMINATION_REASONS,
    Episode,
    EpisodeReattribution,
    EpisodeRelabel,
    EpisodeSandbox,
    EpisodeStatus,
    FailureClass,
    Step,
    StepKind,
    VerifierOutcome,
)
from apps.trajectories.services import lineage
from apps.trajectories.services.attribution import (
    DETECTION_GRACE,
    VERDICT_RULES,
    episode_attribution,
)
from apps.trajectories.services.junit import ReportInvalid, parse_report
from apps.trajectories.services.lineage import raw_event_record
from apps.trajectories.services.secrets import EpisodeSecrets
from apps.trajectories.services.step_schema import step_problem

CONTROL_PLANE_VERSION = "hedgerow/1"
# How far ahead of the server's clock a client's time may be before it is refused.
MAX_CLOCK_SKEW = timedelta(seconds=5)
EPISODE_FIELDS = (
    "task_id",
    "task_version",
    "image",
    "image_digest",
    "initial_state",
    "model",
    "model_version",
    "harness",
    "harness_version",
    "policy_version",
    "attempt_id",
    "sampling",
    "labels",
    "versions",
    *provenance.INPUT_FIELDS,
)

log = logging.getLogger(__name__)


class EpisodeClosed(Conflict):
    code = "episode_closed"


@dataclass(frozen=True)
class StepInput:
    kind: str = StepKind.EXEC
    index: int | None = None
    action: Any = None
    request: Any = None
    observation: dict[str, Any] | None = None
    shown: Any = None
    diff: str = ""
    model_call: dict[str, Any] = field(default_factory=dict)
    sandbox_id: str = ""
    operation_id: str = ""
    started_at: datetime | None = None
    ended_at: datetime | None = None
    duration_s: float | None = None
    verifier: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeResult:
    termination_reason: str = ""
    reward: float | None = None
    reward_components: dict[str, Any] = field(default_factory=dict)
    verifier_name: str = ""
    verifier_version: str = ""
    verifier_outcome: str = ""
    inference_error: Any = None
    ended_at: datetime | None = None
    client_cost: Decimal = Decimal(0)  # model tokens etc., reported by the client


def _sandbox_of(tenant: Tenant, sandbox_id: str) -> Sandbox:
    sandbox = Sandbox.objects.for_tenant(tenant).filter(external_id=sandbox_id).first()
    if sandbox is None:
        raise NotFound(f"no sandbox {sandbox_id!r}", code="sandbox_not_found", field="sandbox_id")
    return sandbox


def _not_in_future(value: datetime | None, name: str, now: datetime) -> None:
    if value is not None and value > now + MAX_CLOCK_SKEW:
        raise ValidationFailed(
            f"{name} {value.isoformat()} is after the server's clock ({now.isoformat()})",
            field=name,
            code="invalid_window",
        )


def episode_open(
    *,
    tenant: Tenant,
    actor: str,
    fields: dict[str, Any],
    sandbox_ids: list[str],
    episode_id: str | None = None,
    started_at: datetime | None = None,
    branch: dict[str, Any] | None = None,
    raw: Any = None,
) -> tuple[Episode, bool]:
    """Records an ``open`` episode and attaches its sandboxes (current generations).

    Idempotent by ``episode_id``: opening an existing id returns it (created=False)
    when task and attempt match, else 409. Every sandbox must be the tenant's (404).
    ``branch`` (``{"parent_episode_id", "step", "snapshot_id"}``): the episode continues
    another after its step ``step``, from a snapshot; all the tenant's (404), the step
    one the parent recorded (400). Without ``snapshot_id`` it is the snapshot the first
    attached sandbox was restored from, if any. Secrets in the metadata are replaced by
    placeholders before anything is stored; ``raw`` (the request as received) is the
    episode's first raw event.
    """
    if not fields.get("task_id"):
        raise ValidationFailed("task_id is required", field="task_id")
    unknown = set(fields) - set(EPISODE_FIELDS)
    if unknown:
        raise ValidationFailed(f"unknown field(s) {sorted(unknown)}", field=sorted(unknown)[0])
    jsonsafe.require_no_nul(fields, "")  # e.g. a sampling or label key: Postgres refuses it
    _not_in_future(started_at, "started_at", timezone.now())
    sandboxes = [_sandbox_of(tenant, sid) for sid in sandbox_ids]
    clean = {k: v for k, v in fields.items() if v is not None}
    if branch:
        clean.update(_branch_fields(tenant, branch, sandboxes))
    clean.setdefault("versions", {})
    clean["versions"] = {**clean["versions"], "control_plane": CONTROL_PLANE_VERSION}
    if episode_id:
        existing = Episode.objects.for_tenant(tenant).filter(episode_id=episode_id).first()
        if existing is not None:
            return _replayed(existing, clean), False
    try:
        with transaction.atomic():
            episode = Episode(
                tenant=tenant,
                created_by=actor,
                started_at=started_at or timezone.now(),
                **({"episode_id": episode_id} if episode_id else {}),
                **clean,
            )
            session = EpisodeSecrets(episode, load=False)
            redact_episode(episode, session)
            episode.save(force_insert=True)
            raw_event_record(
                episode=episode,
                kind="open",
                body=session.redact(raw if raw is not None else lineage.jsonable(fields), ""),
            )
            session.save()
            for sandbox in sandboxes:
                episode_attach_sandbox(episode=episode, sandbox=sandbox)
            provenance_refresh(episode=episode)
    except IntegrityError:
        existing = Episode.objects.for_tenant(tenant).filter(episode_id=episode_id).first()
        if existing is None:
            raise
        return _replayed(existing, clean), False
    return episode, True


def _branch_fields(
    tenant: Tenant, branch: dict[str, Any], sandboxes: list[Sandbox]
) -> dict[str, Any]:
    parent_id = branch.get("parent_episode_id")
    parent = Episode.objects.for_tenant(tenant).filter(episode_id=parent_id).first()
    if parent is None:
        raise NotFound(
            f"no episode {parent_id!r}", code="episode_not_found", field="parent_episode_id"
        )
    step = branch.get("step")
    if step is not None and not parent.steps.filter(index=step).exists():
        raise ValidationFailed(
            f"episode {parent.episode_id} has no step {step}", field="branch_step"
        )
    snapshot = None
    if branch.get("snapshot_id"):
        snapshot = snapshot_get(tenant=tenant, snapshot_id=str(branch["snapshot_id"]))
    elif sandboxes and sandboxes[0].snapshot_id is not None:
        snapshot = sandboxes[0].snapshot
    return {"parent": parent, "branch_step": step, "branch_snapshot": snapshot}


def _replayed(existing: Episode, fields: dict[str, Any]) -> Episode:
    for key in ("task_id", "attempt_id"):
        if key in fields and fields[key] != getattr(existing, key):
            raise Conflict(
                f"episode {existing.episode_id} exists with a different {key}",
                field=key,
                code="episode_exists",
            )
    return existing


def episode_attach_sandbox(
    *, episode: Episode, sandbox: Sandbox, generation: int | None = None
) -> EpisodeSandbox:
    """Links a sandbox generation to the episode. Idempotent per (sandbox, generation).
    A sandbox not yet provisioned (generation 0) is linked without a generation so the
    ledger of the generation it gets is used."""
    gen = generation if generation is not None else (sandbox.generation or None)
    if gen is not None:
        # The generation became known (first exec after provisioning): fill it in.
        EpisodeSandbox.objects.filter(
            episode=episode, sandbox=sandbox, generation__isnull=True
        ).update(generation=gen)
    link, _ = EpisodeSandbox.objects.get_or_create(
        episode=episode,
        sandbox_ref=sandbox.external_id,
        generation=gen,
        defaults={"sandbox": sandbox},
    )
    if sandbox.image_digest and not episode.image_digest:
        # Exactly what the episode ran: the image digest of its (first) sandbox, unless
        # the client recorded one itself. The JSONL export carries it.
        Episode.objects.filter(pk=episode.pk, image_digest="").update(
            image_digest=sandbox.image_digest
        )
        episode.image_digest = sandbox.image_digest
        provenance_refresh(episode=episode)
    return link


def provenance_components(episode: Episode) -> dict[str, str]:
    """The episode's provenance components from its fields: the snapshot is the one a
    branch resumed from, else the one its first sandbox was restored from (forked)."""
    snapshot_id = episode.branch_snapshot_id
    if snapshot_id is None:
        first = (
            EpisodeSandbox.objects.filter(episode=episode, sandbox__snapshot__isnull=False)
            .values_list("sandbox__snapshot_id", flat=True)
            .first()
        )
        snapshot_id = first
    return provenance.components(
        task_hash=episode.task_hash,
        image_digest=episode.image_digest,
        snapshot_id=str(snapshot_id) if snapshot_id else None,
        policy_checkpoint=episode.policy_checkpoint,
        policy_version=episode.policy_version,
        harness_commit=episode.harness_commit,
        verifier_commit=episode.verifier_commit,
        verifier_version=episode.verifier_version,
        sampling=episode.sampling,
        attempt_id=episode.attempt_id,
    )


def provenance_set(*, episode: Episode, parts: dict[str, str]) -> None:
    """Stores components and the keys derived from them (never a key the client sent)."""
    episode.provenance = parts
    episode.provenance_key = provenance.key_of(parts)
    episode.provenance_origin = provenance.origin_of(parts)
    Episode.objects.filter(pk=episode.pk).update(
        provenance=episode.provenance,
        provenance_key=episode.provenance_key,
        provenance_origin=episode.provenance_origin,
    )


def provenance_refresh(*, episode: Episode) -> None:
    """Recomputes the key when a component became known (the image digest when a
    sandbox is attached, the verifier version at close). An imported episode keeps the
    components it was exported with (its sandboxes and snapshots are another
    installation's)."""
    if episode.imported and episode.provenance:
        return
    parts = provenance_components(episode)
    if parts != episode.provenance:
        provenance_set(episode=episode, parts=parts)


def _observation_of(op: Operation) -> dict[str, Any]:
    return {
        "status": op.status,
        "termination": op.termination,
        "exit_code": op.exit_code,
        "signal": op.signal,
        "stdout": op.stdout,
        "stderr": op.stderr,
        "usage": op.usage,
        "children_remained": op.children_remained,
        "error": op.error,
    }


def step_append(*, episode: Episode, steps: list[StepInput], raw: Any = None) -> list[Step]:
    """Appends steps in order to an open episode (409 ``episode_closed`` otherwise).

    An exec step names its ``sandbox_id`` and ``operation_id``: the control plane's
    Operation row is linked and its result becomes the observation (what the client
    sends for those fields is ignored), and the sandbox is attached if it was not.
    Missing indexes continue from the last step. Replaying a step with the same index
    and operation id returns the stored one; a different step at a taken index is 409.
    Every step is checked first (``step_schema``): one bad step is a 400 naming it
    (``steps[i].observation.stdout``) and nothing of the batch is stored.
    """
    for position, item in enumerate(steps):
        _step_check(item, f"steps[{position}]")
    with transaction.atomic():
        locked = Episode.objects.select_for_update().get(pk=episode.pk)
        if locked.status != EpisodeStatus.OPEN:
            raise EpisodeClosed(f"episode {locked.episode_id} is closed")
        last = locked.steps.aggregate(m=Max("index"))["m"]
        next_index = 0 if last is None else last + 1
        stored: list[Step] = []
        session = EpisodeSecrets(locked)
        for item in steps:
            index = item.index if item.index is not None else next_index
            existing = locked.steps.filter(index=index).first()
            if existing is not None:
                if existing.operation_id == item.operation_id and existing.kind == item.kind:
                    stored.append(existing)
                    continue
                raise Conflict(f"step {index} already exists", field="index", code="step_exists")
            stored.append(_step_create(locked, index, item, session))
            next_index = max(next_index, index + 1)
        if raw is None:
            raw = {"steps": [lineage.jsonable(asdict(item)) for item in steps]}
        raw_event_record(
            episode=locked,
            kind="steps",
            body=session.redact(raw, ""),
            produced=[step.index for step in stored],
        )
        session.save()
    return stored


def _step_check(item: StepInput, where: str) -> None:
    fields = {
        "action": item.action,
        "request": item.request,
        "shown": item.shown,
        "diff": item.diff,
        "model_call": item.model_call,
        "duration_s": item.duration_s,
    }
    if not (item.sandbox_id and item.operation_id):
        # Linked exec steps take the operation row as their observation: the client's
        # is ignored, so it is not judged either.
        fields["observation"] = item.observation
    problem = step_problem(fields)
    if problem is not None:
        field, message = problem
        raise ValidationFailed(f"{where}.{field} {message}", field=f"{where}.{field}")


def _step_create(episode: Episode, index: int, item: StepInput, session: EpisodeSecrets) -> Step:
    if item.kind not in StepKind.values:
        raise ValidationFailed(f"unknown step kind {item.kind!r}", field="kind")
    step = Step(
        episode=episode,
        index=index,
        kind=item.kind,
        action=item.action,
        request=item.request,
        observation=item.observation or {},
        shown=item.shown,
        diff=item.diff,
        model_call=item.model_call,
        operation_id=item.operation_id,
        started_at=item.started_at,
        ended_at=item.ended_at,
        duration_s=item.duration_s,
        verifier=_verifier_record(item.verifier),
    )
    if item.sandbox_id:
        sandbox = _sandbox_of(episode.tenant, item.sandbox_id)
        step.sandbox_ref = sandbox.external_id
        if item.operation_id:
            op = Operation.objects.filter(sandbox=sandbox, operation_id=item.operation_id).first()
            if op is None:
                raise NotFound(
                    f"no operation {item.operation_id!r} in sandbox {sandbox.external_id}",
                    code="operation_not_found",
                    field="operation_id",
                )
            step.operation_record = op
            step.generation = op.generation
            step.observation = _observation_of(op)
            # the operation's request without its sealed env values (names only)
            step.request = item.request if item.request is not None else request_public(op.request)
            step.started_at = op.created_at
            step.ended_at = op.finished_at
            wall = (op.usage or {}).get("wall_s")
            step.duration_s = float(wall) if wall is not None else None
        episode_attach_sandbox(
            episode=episode,
            sandbox=sandbox,
            generation=step.generation if step.generation is not None else None,
        )
    elif item.operation_id:
        raise ValidationFailed("operation_id needs sandbox_id", field="sandbox_id")
    redact_step(step, session, f"steps[{index}]")
    step.save()
    return step


# What redaction scans on an episode (identifiers such as task_id and attempt_id stay:
# they are what a client looks episodes up by) and on a step (everything it carries).
REDACTED_EPISODE_FIELDS = (
    "task_version",
    "image",
    "initial_state",
    "model",
    "model_version",
    "harness",
    "harness_version",
    "policy_version",
    "sampling",
    "labels",
    "versions",
    "reward_components",
    "verifier_name",
    "inference_error",
    "failure_evidence",
)
REDACTED_STEP_FIELDS = (
    "action",
    "request",
    "observation",
    "shown",
    "diff",
    "model_call",
    "verifier",
)


def redact_episode(episode: Episode, session: EpisodeSecrets) -> None:
    """Replaces the secrets in the episode's scanned fields. A text field that no longer
    fits once its secrets are placeholders is a 400 naming it (never a database error)."""
    for name in REDACTED_EPISODE_FIELDS:
        value = session.redact(getattr(episode, name), name)
        limit = getattr(Episode._meta.get_field(name), "max_length", None)
        if limit is not None and isinstance(value, str) and len(value) > limit:
            raise ValidationFailed(
                f"{name} is longer than {limit} characters once its secrets are replaced",
                field=name,
            )
        setattr(episode, name, value)


def redact_step(step: Step, session: EpisodeSecrets, where: str) -> None:
    for name in REDACTED_STEP_FIELDS:
        setattr(step, name, session.redact(getattr(step, name), f"{where}.{name}"))


def _verifier_record(declared: dict[str, Any]) -> dict[str, Any]:
    """What a verifier step keeps of its declaration: the kind and, when it declared a
    report, the per-test results parsed from it (or why there are none). The report's
    text itself is not stored."""
    if not declared:
        return {}
    record: dict[str, Any] = {"kind": declared["kind"]}
    if "report" not in declared and not declared.get("report_path"):
        return record
    report: dict[str, Any] = {"format": "junit-xml", "path": declared.get("report_path", "")}
    record["report"] = report
    text = declared.get("report") or ""
    if not text:
        report["error"] = "the verifier wrote no report"
        return record
    if text.lstrip().startswith("{"):
        report["format"] = "json"
    try:
        report["format"], parsed = parse_report(text)
    except ReportInvalid as exc:
        report["error"] = str(exc)
        return record
    record["results"] = parsed.results
    record["summary"] = parsed.summary
    return record


def _resources(episode: Episode) -> dict[str, Any]:
    totals: dict[str, Any] = {
        "steps": 0,
        "exec_steps": 0,
        "wall_s": 0.0,
        "cpu_s": 0.0,
        "max_rss_kb": 0,
        "tokens_in": 0,
        "tokens_out": 0,
        "stdout_bytes": 0,
        "stderr_bytes": 0,
    }
    malformed = 0
    for step in episode.steps.all():
        totals["steps"] += 1
        if step.operation_id:
            totals["exec_steps"] += 1
        if _stored_problem(step) is not None:
            # Stored before steps were checked on append: counted, never summed (and
            # never a reason for the close to fail).
            malformed += 1
            continue
        usage = (step.observation or {}).get("usage") or {}
        totals["wall_s"] += float(usage.get("wall_s") or step.duration_s or 0.0)
        totals["cpu_s"] += float(usage.get("user_cpu_s") or 0) + float(usage.get("sys_cpu_s") or 0)
        totals["max_rss_kb"] = max(totals["max_rss_kb"], int(usage.get("max_rss_kb") or 0))
        for key in ("tokens_in", "tokens_out"):
            totals[key] += int((step.model_call or {}).get(key) or 0)
        for name in ("stdout", "stderr"):
            totals[f"{name}_bytes"] += int(
                ((step.observation or {}).get(name) or {}).get("total_bytes") or 0
            )
    totals["wall_s"] = round(totals["wall_s"], 6)
    totals["cpu_s"] = round(totals["cpu_s"], 6)
    if malformed:
        totals["malformed_steps"] = malformed
    return totals


def _stored_problem(step: Step) -> tuple[str, str] | None:
    return step_problem(
        {
            "observation": step.observation,
            "model_call": step.model_call,
            "duration_s": step.duration_s,
        }
    )


def episode_costs_refresh(*, episodes: list[Episode]) -> None:
    """Re-costs closed episodes (their sandbox shares change as a sandbox accrues,
    ends, or gains another episode)."""
    for episode in episodes:
        sandbox_cost, basis = episode_sandbox_cost(episode=episode)
        Episode.objects.filter(pk=episode.pk).update(
            cost=sandbox_cost + episode.client_cost, cost_basis=basis
        )


def _validate_result(result: EpisodeResult) -> None:
    jsonsafe.require_no_nul(result.reward_components, "reward_components")
    jsonsafe.require_no_nul(result.inference_error, "inference_error")
    if result.termination_reason and result.termination_reason not in TERMINATION_REASONS:
        raise ValidationFailed(
            f"unknown termination_reason {result.termination_reason!r}; "
            f"one of {', '.join(TERMINATION_REASONS)}",
            field="termination_reason",
        )
    if result.client_cost < 0:
        raise ValidationFailed("client_cost must be ≥ 0", field="client_cost")
    if result.verifier_outcome and result.verifier_outcome not in VerifierOutcome.values:
        raise ValidationFailed(
            f"verifier outcome is one of {', '.join(VerifierOutcome.values)}",
            field="verifier_outcome",
        )


def episode_close(*, episode: Episode, result: EpisodeResult, raw: Any = None) -> Episode:
    """Closes an open episode (CAS open → closed), stores the outcome, resource
    totals and cost, and applies the decision procedure. Idempotent: closing a
    closed episode returns it unchanged. An impossible window (``ended_at`` before
    ``started_at`` or after the server's clock) is a 400 ``invalid_window``."""
    _validate_result(result)
    now = timezone.now()
    if episode.status == EpisodeStatus.OPEN:
        _not_in_future(result.ended_at, "ended_at", now)
        if result.ended_at is not None and result.ended_at < episode.started_at:
            raise ValidationFailed(
                f"ended_at {result.ended_at.isoformat()} is before the episode's "
                f"started_at {episode.started_at.isoformat()}",
                field="ended_at",
                code="invalid_window",
            )
    with transaction.atomic():
        locked = Episode.objects.select_for_update().get(pk=episode.pk)
        if locked.status != EpisodeStatus.OPEN:
            episode.refresh_from_db()
            return episode
        session = EpisodeSecrets(locked)
        Episode.objects.filter(pk=episode.pk, status=EpisodeStatus.OPEN).update(
            status=EpisodeStatus.CLOSED,
            ended_at=result.ended_at or now,
            termination_reason=result.termination_reason,
            reward=result.reward,
            reward_components=session.redact(result.reward_components, "reward_components"),
            verifier_name=session.text(result.verifier_name, "verifier_name")[:200],
            verifier_version=result.verifier_version,
            verifier_outcome=result.verifier_outcome,
            inference_error=session.redact(result.inference_error, "inference_error"),
            client_cost=result.client_cost,
        )
        if raw is None:
            raw = lineage.jsonable(asdict(result))
        raw_event_record(episode=locked, kind="close", body=session.redact(raw, ""))
        session.save()
        episode.refresh_from_db()
        provenance_refresh(episode=episode)  # the verifier's version is known now
        episode_attribute(episode=episode)
        lineage.normalize(episode=episode, actor="close")
    episode_capture_dns(episode=episode)
    return episode


DNS_EVIDENCE_MAX = 200  # entries kept per sandbox link (the last ones)
DNS_EVIDENCE_SLACK_S = 5.0  # a lookup logged just after a client-stamped end still counts


def episode_capture_dns(*, episode: Episode) -> None:
    """Copies each attached sandbox's DNS queries within the episode's window (and its
    generation) onto the link, as evidence that outlives the sandbox (docs/egress.md
    "The query log"). A backend without a resolver, or a sandbox whose state is gone,
    records an empty list; a backend error records nothing (None) and is logged."""

    start = episode.started_at.timestamp()
    end = (episode.ended_at or timezone.now()).timestamp() + DNS_EVIDENCE_SLACK_S
    for link in episode.sandbox_links.select_related("sandbox"):
        if link.sandbox is None:
            continue
        try:
            entries = sandbox_dns_log(sandbox=link.sandbox)
        except BackendError as exc:
            log.warning("DNS log of %s not captured: %s", link.sandbox_ref, exc)
            continue
        mine = [
            e
            for e in entries
            if (link.generation is None or e.get("generation") == link.generation)
            and start <= float(e.get("ts") or 0) <= end
        ]
        link.dns_log = mine[-DNS_EVIDENCE_MAX:]
        link.dns_log_total = len(mine)
        link.save(update_fields=["dns_log", "dns_log_total"])


def episode_attribute(*, episode: Episode) -> Episode:
    """(Re)applies the decision procedure and recomputes resources and cost of a closed
    episode. A person's label is never overwritten: only ``auto_failure_class``
    changes under it. An imported episode is attributed from this ledger only where
    it names this tenant's sandboxes (its claim stays in ``claimed_class``); otherwise
    it keeps what it came with."""
    if episode.status != EpisodeStatus.CLOSED:
        return episode
    if episode.imported:
        return _imported_attribute(episode)
    verdict = episode_attribution(episode=episode)
    relabeled = episode.relabels.exists()
    episode.auto_failure_class = verdict.failure_class
    if not relabeled:
        episode.failure_class = verdict.failure_class
    episode.failure_evidence = verdict.as_evidence()
    episode.resources = _resources(episode)
    sandbox_cost, episode.cost_basis = episode_sandbox_cost(episode=episode)
    episode.cost = sandbox_cost + episode.client_cost
    episode.save(
        update_fields=[
            "auto_failure_class",
            "failure_class",
            "failure_evidence",
            "resources",
            "cost",
            "cost_basis",
        ]
    )
    # Episodes sharing a sandbox with this one now share its cost with one more.
    pks = [link.sandbox_id for link in episode.sandbox_links.all() if link.sandbox_id]
    if pks:
        episode_costs_refresh(
            episodes=[e for e in sharing_episodes(sandbox_pks=pks) if e.pk != episode.pk]
        )
    return episode


# The sweep looks a little past the grace so a run that is late still sees it once.
SWEEP_SLACK = timedelta(seconds=60)


def episodes_reattribute_recent(*, now: datetime | None = None, limit: int = 1000) -> int:
    """Re-runs attribution for episodes that closed within the detection grace, so a
    loss the watcher noticed after the harness closed is attributed without a manual
    ``/attribute``. A verdict reached while healthy stands (the procedure ignores what
    came after it), and episodes past the grace are never touched. Returns how many
    changed class."""
    now = now or timezone.now()
    recent = (
        Episode.objects.filter(
            status=EpisodeStatus.CLOSED,
            imported=False,
            ended_at__gte=now - DETECTION_GRACE - SWEEP_SLACK,
            sandbox_links__sandbox__isnull=False,
        )
        .exclude(auto_failure_class__in=(FailureClass.STARTUP, FailureClass.ENVIRONMENT))
        .distinct()
        .order_by("ended_at")[:limit]
    )
    changed = 0
    for episode in recent:
        if episode_reattribute(
            episode=episode,
            cause="ledger_changed_in_grace",
            reason="a linked sandbox's ledger changed within the detection grace after close",
        ):
            changed += 1
    return changed


def episode_reattribute(
    *, episode: Episode, cause: str, reason: str, evidence: list[dict[str, Any]] | None = None
) -> EpisodeReattribution | None:
    """Re-runs attribution of a closed, non-imported episode after something it reads
    changed (``cause``, e.g. its task's verifier became suspect). Idempotent: nothing
    is written unless the automatic class changes; a change is recorded (from, to, the
    verifier's verdict, cause, reason, evidence — by default the new verdict's facts). A
    person's relabel still stands."""
    with transaction.atomic():
        locked = Episode.objects.select_for_update().filter(pk=episode.pk).first()
        if locked is None or locked.status != EpisodeStatus.CLOSED or locked.imported:
            return None
        verdict = episode_attribution(episode=locked)
        if verdict.failure_class == locked.auto_failure_class:
            return None
        before = locked.auto_failure_class
        episode_attribute(episode=locked)
        verdict_class = verdict.verdict_class or (
            verdict.failure_class if verdict.rule in VERDICT_RULES else ""
        )
        return EpisodeReattribution.objects.create(
            tenant_id=locked.tenant_id,
            episode=locked,
            from_class=before,
            to_class=verdict.failure_class,
            verdict_class=verdict_class,
            cause=cause,
            reason=reason,
            evidence=verdict.evidence if evidence is None else evidence,
        )


def _imported_attribute(episode: Episode) -> Episode:
    """The ledger's word on an imported episode whose sandboxes are this tenant's: the
    claimed class is kept beside it, and a disagreement is a fact in the evidence."""
    if not episode.sandbox_links.filter(sandbox__isnull=False).exists():
        return episode
    verdict = episode_attribution(episode=episode)
    claimed = episode.claimed_class
    evidence = verdict.as_evidence()
    if claimed and claimed != verdict.failure_class:
        evidence.append(
            {
                "class": "note",
                "source": "import",
                "detail": f"the import claimed {claimed}; this installation's ledger says "
                f"{verdict.failure_class}",
                "claimed_class": claimed,
            }
        )
    episode.auto_failure_class = verdict.failure_class
    if not episode.relabels.exists():
        episode.failure_class = verdict.failure_class
    episode.failure_evidence = evidence
    episode.save(update_fields=["auto_failure_class", "failure_class", "failure_evidence"])
    return episode


def episode_relabel(*, episode: Episode, failure_class: str, reason: str, actor: str) -> Episode:
    """A person sets the failure class of a closed episode. Appends to the audit trail
    (from, to, reason, who, when); the automatic label is kept."""
    if failure_class not in FailureClass.values:
        raise ValidationFailed(
            f"failure_class is one of {', '.join(FailureClass.values)}", field="failure_class"
        )
    if not reason.strip():
        raise ValidationFailed("a relabel needs a reason", field="reason")
    with transaction.atomic():
        locked = Episode.objects.select_for_update().get(pk=episode.pk)
        if locked.status != EpisodeStatus.CLOSED:
            raise Conflict("only a closed episode can be relabeled", code="episode_open")
        EpisodeRelabel.objects.create(
            episode=locked,
            from_class=locked.failure_class,
            to_class=failure_class,
            reason=reason.strip(),
            actor=actor,
        )
        locked.failure_class = failure_class
        locked.save(update_fields=["failure_class"])
    episode.refresh_from_db()
    return episode
