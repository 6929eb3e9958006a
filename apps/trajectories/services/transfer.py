"""JSONL export/import: one episode per line, schema ``hedgerow.episode/v1``
(docs/trajectories.md). Export → import → export gives the same lines.

Import checks every line and reports line-numbered errors without stopping at the
first; each valid line is stored in its own savepoint, so one bad line never takes
the others down. Sandboxes and operations stay references (ids and generations):
they belong to the installation that recorded them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils.dateparse import parse_datetime

from apps.core import jsonsafe
from apps.core.errors import ApiError
from apps.core.inputs import json_loads
from apps.sandboxes.models import Operation, Sandbox, Snapshot
from apps.tenancy.models import Tenant
from apps.trajectories import provenance
from apps.trajectories.models import (
    Episode,
    EpisodeRelabel,
    EpisodeSandbox,
    EpisodeStatus,
    FailureClass,
    Step,
    StepKind,
    VerifierKind,
)
from apps.trajectories.services.episodes import (
    episode_attribute,
    provenance_refresh,
    provenance_set,
    redact_episode,
    redact_step,
)
from apps.trajectories.services.lineage import (
    export_record,
    normalize,
    raw_event_record,
    step_record,
)
from apps.trajectories.services.secrets import EpisodeSecrets
from apps.trajectories.services.step_schema import step_problem

SCHEMA = "hedgerow.episode/v1"
# Step.index is a PositiveIntegerField (Postgres integer).
MAX_INDEX = 2**31 - 1
MAX_ERRORS = 1000
_TEXT = (
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
    "termination_reason",
    *provenance.INPUT_FIELDS,
)
_OBJECTS = ("sampling", "labels", "reward_components", "versions", "resources")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def episode_to_record(episode: Episode) -> dict[str, Any]:
    """The episode's ``hedgerow.episode/v1`` record, as every export writes it: secrets
    replaced by the episode's placeholders. What was stored before redaction existed
    (or slipped past it) is caught here; its new placeholders are stored then."""
    record = _raw_record(episode)
    session = EpisodeSecrets(episode)
    redacted = session.redact(record, "")
    if not session.redactor.found:
        return dict(redacted)
    with transaction.atomic():  # new secrets: take the row lock, then redact again
        locked = Episode.objects.select_for_update().get(pk=episode.pk)
        session = EpisodeSecrets(locked)
        redacted = session.redact(record, "")
        session.save(count_known=False)
    return dict(redacted)


def _raw_record(episode: Episode) -> dict[str, Any]:
    record: dict[str, Any] = {"schema": SCHEMA, "episode_id": episode.episode_id}
    record["status"] = episode.status
    for name in _TEXT:
        record[name] = getattr(episode, name)
    for name in _OBJECTS:
        record[name] = getattr(episode, name)
    record.update(
        started_at=_iso(episode.started_at),
        ended_at=_iso(episode.ended_at),
        reward=episode.reward,
        verifier={
            "name": episode.verifier_name,
            "version": episode.verifier_version,
            "outcome": episode.verifier_outcome,
        },
        inference_error=episode.inference_error,
        cost=str(episode.cost),
        failure={
            "auto_class": episode.auto_failure_class,
            "class": episode.failure_class,
            "evidence": episode.failure_evidence,
            **(
                {"claimed": episode.claimed_class}
                if episode.claimed_class and episode.claimed_class != episode.failure_class
                else {}
            ),
            "relabels": [
                {
                    "from": r.from_class,
                    "to": r.to_class,
                    "reason": r.reason,
                    "actor": r.actor,
                    "at": _iso(r.at),
                }
                for r in episode.relabels.all()
            ],
        },
        sandboxes=[
            {
                "sandbox_id": link.sandbox_ref,
                "generation": link.generation,
                "attached_at": _iso(link.attached_at),
            }
            for link in episode.sandbox_links.all()
        ],
        steps=[step_record(step) for step in episode.steps.all()],
        provenance={
            "key": episode.provenance_key,
            "origin": episode.provenance_origin,
            "components": episode.provenance,
        },
    )
    if episode.parent_id is not None:  # a branch (docs/trajectories.md, "Branches")
        assert episode.parent is not None
        record["branch"] = {
            "parent_episode_id": episode.parent.episode_id,
            "step": episode.branch_step,
            "snapshot_id": str(episode.branch_snapshot_id) if episode.branch_snapshot_id else None,
        }
    return record


def episodes_export(
    *,
    episodes: QuerySet[Episode],
    recorded_as: dict[str, Any] | None = None,
) -> Iterator[str]:
    """One JSON line per episode (oldest first), streamed, secrets redacted. With
    ``recorded_as`` (``{"tenant", "actor", "filters"}``) the episodes handed out are
    recorded as a LineageExport when the stream ends (or is cut), so a later deletion
    request lists this export."""
    ordered = episodes.order_by("started_at", "created_at").prefetch_related(
        "steps", "relabels", "sandbox_links"
    )
    sent: list[str] = []
    try:
        for episode in ordered.iterator(chunk_size=200):
            line = json.dumps(episode_to_record(episode), sort_keys=True, ensure_ascii=False)
            sent.append(episode.episode_id)
            yield line + "\n"
    finally:
        if recorded_as is not None and sent:
            export_record(
                tenant=recorded_as["tenant"],
                episode_ids=sent,
                actor=recorded_as.get("actor", ""),
                filters=recorded_as.get("filters", {}),
                kind="episodes.jsonl",
            )


class RecordError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "imported": len(self.imported),
            "episode_ids": self.imported,
            "failed": len({e["line"] for e in self.errors}),
            "errors": self.errors[:MAX_ERRORS],
            "dry_run": self.dry_run,
        }


def _text(data: dict[str, Any], name: str, required: bool = False, limit: int = 200) -> str:
    value = data.get(name, "")
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise RecordError(name, "must be a string")
    if required and not value:
        raise RecordError(name, "is required")
    if len(value) > limit:
        raise RecordError(name, f"longer than {limit} characters")
    return value


def _obj(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise RecordError(name, "must be an object")
    return value


def _verifier_declaration(data: dict[str, Any]) -> dict[str, Any]:
    value = _obj(data, "verifier")
    if value and value.get("kind") not in VerifierKind.values:
        raise RecordError("verifier.kind", f"one of {', '.join(VerifierKind.values)}")
    return value


def _time(data: dict[str, Any], name: str, required: bool = False) -> datetime | None:
    value = data.get(name)
    if value is None:
        if required:
            raise RecordError(name, "is required")
        return None
    parsed = parse_datetime(value) if isinstance(value, str) else None
    if parsed is None or parsed.tzinfo is None:
        raise RecordError(name, "must be an ISO 8601 time with a UTC offset")
    return parsed


def _required_time(data: dict[str, Any], name: str) -> datetime:
    value = _time(data, name, required=True)
    assert value is not None
    return value


def _num(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(name, "must be a number")
    return float(value)


def _build(
    tenant: Tenant, data: Any
) -> tuple[Episode, list[Step], list[Any], list[Any], dict[str, str] | None]:
    """Validates one record and builds unsaved rows. Raises RecordError."""
    if not isinstance(data, dict):
        raise RecordError("", "a line must be a JSON object")
    if data.get("schema") != SCHEMA:
        raise RecordError("schema", f"must be {SCHEMA!r} (got {data.get('schema')!r})")
    nul = jsonsafe.nul_path(data)
    if nul is not None:  # Postgres cannot store it (jsonb or text): a line error, not a 500
        raise RecordError(nul, "contains a NUL character, which cannot be stored")
    status = data.get("status", EpisodeStatus.CLOSED)
    if status not in EpisodeStatus.values:
        raise RecordError("status", f"must be one of {EpisodeStatus.values}")
    failure = _obj(data, "failure")
    verifier = _obj(data, "verifier")
    for key in ("auto_class", "class"):
        value = failure.get(key) or ""
        if value and value not in FailureClass.values:
            raise RecordError(f"failure.{key}", f"unknown failure class {value!r}")
    try:
        cost = Decimal(str(data.get("cost") or "0"))
    except InvalidOperation:
        raise RecordError("cost", "must be a decimal number") from None
    episode = Episode(
        tenant=tenant,
        episode_id=_text(data, "episode_id", required=True, limit=64),
        status=status,
        started_at=_required_time(data, "started_at"),
        ended_at=_time(data, "ended_at"),
        reward=_num(data, "reward"),
        verifier_name=_text(verifier, "name"),
        verifier_version=_text(verifier, "version", limit=100),
        verifier_outcome=_text(verifier, "outcome", limit=16),
        inference_error=data.get("inference_error"),
        cost=cost,
        auto_failure_class=failure.get("auto_class") or "",
        failure_class=failure.get("class") or "",
        failure_evidence=failure.get("evidence") or [],
        claimed_class=failure.get("claimed") or failure.get("class") or "",
        imported=True,
        created_by="import",
        **{name: _text(data, name, required=name == "task_id") for name in _TEXT},
        **{name: _obj(data, name) for name in _OBJECTS},
    )
    if episode.ended_at is not None and episode.ended_at < episode.started_at:
        raise RecordError("ended_at", "is before started_at (an impossible window)")
    branch = _obj(data, "branch")
    if branch:
        # linked when this tenant has the parent already (import parents first); the
        # snapshot only when it is this tenant's (it is never another installation's)
        parent_id = _text(branch, "parent_episode_id", required=True, limit=64)
        episode.parent = Episode.objects.for_tenant(tenant).filter(episode_id=parent_id).first()
        step = branch.get("step")
        if step is not None and (not isinstance(step, int) or step < 0):
            raise RecordError("branch.step", "must be a step index")
        episode.branch_step = step
        snapshot_id = branch.get("snapshot_id")
        if snapshot_id:
            try:
                episode.branch_snapshot = (
                    Snapshot.objects.for_tenant(tenant).filter(pk=str(snapshot_id)).first()
                )
            except ValidationError:
                raise RecordError("branch.snapshot_id", "is not a snapshot id") from None
    steps = [_build_step(episode, i, s) for i, s in enumerate(data.get("steps") or [])]
    if len({s.index for s in steps}) != len(steps):
        raise RecordError("steps", "step indexes repeat")
    links = [
        EpisodeSandbox(
            episode=episode,
            sandbox_ref=_text(s, "sandbox_id", required=True, limit=63),
            generation=s.get("generation"),
            attached_at=_required_time(s, "attached_at"),
        )
        for s in data.get("sandboxes") or []
    ]
    _resolve_local(tenant, links, steps)
    relabels = [
        EpisodeRelabel(
            episode=episode,
            from_class=_text(r, "from", limit=16),
            to_class=_text(r, "to", required=True, limit=16),
            reason=_text(r, "reason", required=True, limit=10000),
            actor=_text(r, "actor", limit=128),
            at=_required_time(r, "at"),
        )
        for r in failure.get("relabels") or []
    ]
    # The exporting installation's components (its image digests and snapshots); the
    # keys are recomputed from them here, never taken from the line.
    parts = provenance.clean_components(_obj(data, "provenance").get("components"))
    return episode, steps, links, relabels, parts


def _resolve_local(tenant: Tenant, links: list[EpisodeSandbox], steps: list[Step]) -> None:
    """Links the sandboxes (and their operations) the record names that are this
    tenant's: the ledger then knows them and attributes the episode (item 6). Another
    tenant's sandbox of the same name is never linked."""
    refs = {link.sandbox_ref for link in links} | {s.sandbox_ref for s in steps if s.sandbox_ref}
    local = {
        sb.external_id: sb for sb in Sandbox.objects.for_tenant(tenant).filter(external_id__in=refs)
    }
    if not local:
        return
    for link in links:
        link.sandbox = local.get(link.sandbox_ref)
    for step in steps:
        sandbox = local.get(step.sandbox_ref)
        if sandbox is not None and step.operation_id:
            step.operation_record = Operation.objects.filter(
                sandbox=sandbox, operation_id=step.operation_id
            ).first()


def _build_step(episode: Episode, position: int, data: Any) -> Step:
    where = f"steps[{position}]"
    if not isinstance(data, dict):
        raise RecordError(where, "must be an object")
    try:
        kind = _text(data, "kind", required=True, limit=16)
        if kind not in StepKind.values:
            raise RecordError("kind", f"unknown step kind {kind!r}")
        index = data.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_INDEX:
            raise RecordError("index", f"must be an integer from 0 to {MAX_INDEX}")
        problem = step_problem(data)  # what close, export and the pages rely on
        if problem is not None:
            raise RecordError(*problem)
        return Step(
            episode=episode,
            index=index,
            kind=kind,
            action=data.get("action"),
            request=data.get("request"),
            observation=_obj(data, "observation"),
            shown=data.get("shown"),
            diff=_text(data, "diff", limit=10_000_000),
            model_call=_obj(data, "model_call"),
            sandbox_ref=_text(data, "sandbox_id", limit=63),
            generation=data.get("generation"),
            operation_id=_text(data, "operation_id", limit=128),
            started_at=_time(data, "started_at"),
            ended_at=_time(data, "ended_at"),
            duration_s=_num(data, "duration_s"),
            verifier=_verifier_declaration(data),
        )
    except RecordError as exc:
        raise RecordError(f"{where}.{exc.field}", exc.message) from None


def episodes_import(
    *, tenant: Tenant, lines: Iterable[bytes | str], dry_run: bool = False
) -> ImportReport:
    """Imports JSONL into the tenant. Blank lines are skipped. An ``episode_id`` the
    tenant already has is an error for that line (import is not an update)."""
    report = ImportReport(dry_run=dry_run)
    for number, raw in enumerate(lines, start=1):
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not text.strip():
            continue
        report.lines += 1
        try:
            data = json_loads(text)  # bounded depth, no lone surrogates (apps/core/inputs.py)
        except ApiError as exc:
            report.errors.append({"line": number, "field": exc.field, "message": exc.message})
            continue
        try:
            episode, steps, links, relabels, parts = _build(tenant, data)
        except RecordError as exc:
            report.errors.append(
                {"line": number, "field": exc.field or None, "message": exc.message}
            )
            continue
        taken = episode.episode_id in report.imported
        if taken or Episode.objects.filter(tenant=tenant, episode_id=episode.episode_id).exists():
            report.errors.append(
                {
                    "line": number,
                    "field": "episode_id",
                    "message": f"episode {episode.episode_id} already exists",
                }
            )
            continue
        if dry_run:
            report.imported.append(episode.episode_id)
            continue
        session = EpisodeSecrets(episode, load=False)
        try:
            redact_episode(episode, session)
        except ApiError as exc:
            report.errors.append({"line": number, "field": exc.field, "message": exc.message})
            continue
        for step in steps:
            redact_step(step, session, f"steps[{step.index}]")
        for relabel in relabels:
            relabel.reason = session.text(relabel.reason, "failure.relabels.reason")
        try:
            with transaction.atomic():
                episode.save()
                raw_event_record(
                    episode=episode,
                    kind="import",
                    body=session.redact(data, ""),
                    produced=[step.index for step in steps],
                )
                session.save()
                Step.objects.bulk_create(steps)
                EpisodeSandbox.objects.bulk_create(links)
                EpisodeRelabel.objects.bulk_create(relabels)
                if parts is not None:
                    provenance_set(episode=episode, parts=parts)
                else:
                    provenance_refresh(episode=episode)
                episode_attribute(episode=episode)
                normalize(episode=episode, actor="import")
        except IntegrityError as exc:
            report.errors.append({"line": number, "field": None, "message": str(exc)[:300]})
            continue
        report.imported.append(episode.episode_id)
    return report
