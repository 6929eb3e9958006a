"""Retention: thins what an ended sandbox's operations keep, after N days, without
touching what the money and the audit stand on (docs/operations.md "Retention").

Two stages per ended sandbox (``deleted``, ``failed``, ``lost``), oldest end first:

1. after ``HEDGEROW_RETENTION_OUTPUT_DAYS``: each finished operation's output windows
   (``stdout``/``stderr`` head and tail) are replaced by ``{"pruned": true,
   "total_bytes": …}`` and its Redis replay buffer (if any is left) is deleted;
2. after ``HEDGEROW_RETENTION_OPERATION_DAYS``: its finished operation rows are
   replaced by ``OperationSummary`` rows (counts, durations, the exec histogram's
   bucket counts per sandbox × kind × status × error code) and deleted. An operation
   another row still references (a trajectory step's ``operation_record``) is kept.

Never touched: the sandbox row, its lifecycle ledger (``SandboxEvent``), usage and
storage records, daily roll-ups, snapshots, audits. The audit's equation reads only
sandboxes and the ledger, and cost reads only usage records, so both are exactly what
they were. A sandbox that is not ended (live, queued, paused) is never thinned.

Bounded and idempotent: a run does at most ``HEDGEROW_RETENTION_MAX_BATCHES`` batches
of at most ``HEDGEROW_RETENTION_BATCH`` operations, each batch one transaction (the
summary upsert and the delete commit together, so a crash mid-run double-counts
nothing); the sandbox rows it works on are locked ``SKIP LOCKED`` (two runs at once
share the work). What is due is read through a partial index that holds only ended,
not yet summarized sandboxes, so a run's cost follows what is due, not the history.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q, QuerySet
from django.db.models.functions import JSONObject
from django.utils import timezone

from apps.core.redis_sync import redis_client
from apps.sandboxes.models import (
    EXEC_BUCKETS,
    FINAL_STATES,
    RETENTION_FULL,
    RETENTION_OUTPUT_PRUNED,
    RETENTION_SUMMARIZED,
    Operation,
    OperationStatus,
    OperationSummary,
    Sandbox,
)
from apps.sandboxes.services import replay

log = logging.getLogger(__name__)

FINISHED = (OperationStatus.COMPLETED, OperationStatus.FAILED)


@dataclass
class RetentionResult:
    outputs_pruned: int = 0
    operations_summarized: int = 0
    summaries_written: int = 0
    sandboxes_output_done: int = 0
    sandboxes_summarized: int = 0
    stream_keys_deleted: int = 0
    batches: int = 0
    # True when the run stopped at its batch bound with work left (the next run goes on)
    more: bool = False
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "outputs_pruned": self.outputs_pruned,
            "operations_summarized": self.operations_summarized,
            "summaries_written": self.summaries_written,
            "sandboxes_output_done": self.sandboxes_output_done,
            "sandboxes_summarized": self.sandboxes_summarized,
            "stream_keys_deleted": self.stream_keys_deleted,
            "batches": self.batches,
            "more": self.more,
        }


def _cutoff(now: datetime, days: float) -> datetime | None:
    return now - timedelta(days=days) if days > 0 else None


def _due(stage: int, cutoff: datetime, limit: int) -> list[Any]:
    """Ids of ended sandboxes at ``stage`` that ended before ``cutoff``, oldest first,
    locked for this transaction (``SKIP LOCKED``: a concurrent run takes others).
    ``updated_at`` is the last transition's time (nothing moves an ended sandbox's
    row on but a label edit, which only makes it look younger: never pruned early)."""
    return list(
        Sandbox.objects.filter(state__in=FINAL_STATES, retention=stage, updated_at__lt=cutoff)
        .order_by("updated_at")
        .select_for_update(skip_locked=True)
        .values_list("pk", flat=True)[:limit]
    )


def _unreferenced(queryset: QuerySet[Operation]) -> QuerySet[Operation]:
    """Leaves out operations another model still points at (a trajectory step's
    ``operation_record``): found from the model graph, so no app is imported here."""
    for rel in Operation._meta.get_fields(include_hidden=True):
        if rel.auto_created and not rel.concrete and (rel.one_to_many or rel.one_to_one):
            model = rel.related_model
            name = rel.field.name  # type: ignore[union-attr]
            queryset = queryset.filter(
                ~Exists(model._base_manager.filter(**{name: OuterRef("pk")}))  # type: ignore[union-attr]
            )
    return queryset


def _advance(ids: Iterable[Any], remaining: QuerySet[Operation], stage: int) -> int:
    """Moves the sandboxes of ``ids`` with nothing of ``remaining`` left to ``stage``."""
    ids = list(ids)
    if not ids:
        return 0
    busy = set(remaining.filter(sandbox_id__in=ids).values_list("sandbox_id", flat=True))
    done = [pk for pk in ids if pk not in busy]
    # .update(): no auto_now, so updated_at keeps meaning "when it ended"
    return Sandbox.objects.filter(pk__in=done, retention__lt=stage).update(retention=stage)


def _drop_streams(pks: list[Any], result: RetentionResult) -> None:
    """Deletes any replay buffer still in Redis (they expire on their own after
    ``HEDGEROW_STREAM_REPLAY_TTL_S``; this is for long TTLs and keys without one).
    Redis being down costs nothing here: the keys expire anyway."""
    if not pks:
        return
    keys: list[str] = []
    for pk in pks:
        keys += [replay.frames_key(str(pk)), replay.bytes_key(str(pk))]
    try:
        client = redis_client()
        for start in range(0, len(keys), 1000):
            result.stream_keys_deleted += int(client.delete(*keys[start : start + 1000]))  # type: ignore[arg-type]
    except redis.RedisError as exc:
        result.errors.append(f"redis: {exc}")
        log.warning("retention: replay buffers left to their TTL: %s", exc)


def _pruned_window(name: str) -> JSONObject:
    return JSONObject(
        pruned=True,
        total_bytes=F(f"{name}__total_bytes"),
        truncated=F(f"{name}__truncated"),
    )


def _output_batch(cutoff: datetime, budget: int, result: RetentionResult) -> int:
    """One transaction: prunes up to ``budget`` output windows. Returns the rows done."""
    with transaction.atomic():
        ids = _due(RETENTION_FULL, cutoff, budget)
        if not ids:
            return 0
        pending = Operation.objects.filter(sandbox_id__in=ids, status__in=FINISHED).exclude(
            stdout__has_key="pruned"
        )
        pks = list(
            pending.order_by("sandbox_id", "created_at")
            .select_for_update(skip_locked=True)
            .values_list("pk", flat=True)[:budget]
        )
        if pks:
            Operation.objects.filter(pk__in=pks).update(
                stdout=_pruned_window("stdout"), stderr=_pruned_window("stderr")
            )
        result.outputs_pruned += len(pks)
        result.sandboxes_output_done += _advance(ids, pending, RETENTION_OUTPUT_PRUNED)
    _drop_streams(pks, result)
    return len(pks) or 1  # a batch that only advanced sandboxes still counts as work


def _bucket_counts(duration: float | None) -> list[int]:
    if duration is None:
        return [0] * len(EXEC_BUCKETS)
    return [1 if duration <= le else 0 for le in EXEC_BUCKETS]


def _summarize_batch(cutoff: datetime, budget: int, result: RetentionResult) -> int:
    """One transaction: replaces up to ``budget`` operation rows by summaries."""
    with transaction.atomic():
        ids = _due(RETENTION_OUTPUT_PRUNED, cutoff, budget)
        ids += _due(RETENTION_FULL, cutoff, budget)  # output stage off, or behind
        if not ids:
            return 0
        pending = _unreferenced(Operation.objects.filter(sandbox_id__in=ids, status__in=FINISHED))
        rows = list(
            pending.order_by("sandbox_id", "created_at")
            .select_for_update(skip_locked=True, of=("self",))
            .values_list(
                "pk",
                "tenant_id",
                "sandbox_id",
                "kind",
                "status",
                "error__code",
                "created_at",
                "finished_at",
            )[:budget]
        )
        groups: dict[tuple[Any, str, str, str], dict[str, Any]] = {}
        for _pk, tenant_id, sandbox_id, kind, status, code, created, finished in rows:
            code = str(code or ("unknown" if status == OperationStatus.FAILED else ""))
            key = (sandbox_id, kind, status, code)
            group = groups.setdefault(
                key,
                {
                    "tenant_id": tenant_id,
                    "count": 0,
                    "finished": 0,
                    "duration_s": 0.0,
                    "buckets": [0] * len(EXEC_BUCKETS),
                    "first_at": created,
                    "last_at": created,
                },
            )
            duration = (finished - created).total_seconds() if finished is not None else None
            group["count"] += 1
            if duration is not None:
                group["finished"] += 1
                group["duration_s"] += duration
            group["buckets"] = [
                a + b for a, b in zip(group["buckets"], _bucket_counts(duration), strict=True)
            ]
            group["first_at"] = min(group["first_at"], created)
            group["last_at"] = max(group["last_at"], created)
        for (sandbox_id, kind, status, code), group in groups.items():
            summary = (
                OperationSummary.objects.select_for_update()
                .filter(sandbox_id=sandbox_id, kind=kind, status=status, error_code=code)
                .first()
            )
            if summary is None:
                OperationSummary.objects.create(
                    sandbox_id=sandbox_id, kind=kind, status=status, error_code=code, **group
                )
            else:
                summary.count += group["count"]
                summary.finished += group["finished"]
                summary.duration_s += group["duration_s"]
                summary.buckets = [
                    a + b for a, b in zip(summary.buckets, group["buckets"], strict=True)
                ]
                summary.first_at = min(summary.first_at, group["first_at"])
                summary.last_at = max(summary.last_at, group["last_at"])
                summary.save()
            result.summaries_written += 1
        pks = [row[0] for row in rows]
        if pks:
            Operation.objects.filter(pk__in=pks).delete()
        result.operations_summarized += len(pks)
        result.sandboxes_summarized += _advance(ids, pending, RETENTION_SUMMARIZED)
    _drop_streams(pks, result)
    return len(pks) or 1


def retention_apply(
    *,
    now: datetime | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
) -> RetentionResult:
    """One bounded run of both stages (the ``apply-retention`` beat task). Safe to run
    at any time, twice at once, or after a crash: what is done is never done again."""
    now = now or timezone.now()
    batch = max(1, batch_size or settings.HEDGEROW_RETENTION_BATCH)
    bound = max(1, max_batches or settings.HEDGEROW_RETENTION_MAX_BATCHES)
    result = RetentionResult()
    output_cut = _cutoff(now, settings.HEDGEROW_RETENTION_OUTPUT_DAYS)
    rows_cut = _cutoff(now, settings.HEDGEROW_RETENTION_OPERATION_DAYS)
    stages = [
        (name, step, cut)
        for name, step, cut in (
            ("output", _output_batch, output_cut),
            ("operations", _summarize_batch, rows_cut),
        )
        if cut is not None
    ]
    for name, step, cut in stages:
        while True:
            if result.batches >= bound:
                result.more = True
                break
            if not step(cut, batch, result):
                break
            result.batches += 1
            log.info(
                "retention: %s batch %d done; so far %s",
                name,
                result.batches,
                result.as_dict(),
                extra={"event": "retention_batch"},
            )
    log.info("retention: run done: %s", result.as_dict(), extra={"event": "retention_run"})
    return result


def operation_summary_totals() -> dict[str, Any]:
    """The summaries' share of the exec histogram and the agent error counter, read
    whole: the recount the metrics' tallies are checked against (the tallies carry the
    summaries' share themselves, ``services/metrics_tally.py``)."""
    buckets = [0] * len(EXEC_BUCKETS)
    finished, duration = 0, 0.0
    errors: dict[str, int] = {}
    for status, code, n, done, seconds, counts in OperationSummary.objects.values_list(
        "status", "error_code", "count", "finished", "duration_s", "buckets"
    ).filter(Q(finished__gt=0) | Q(status=OperationStatus.FAILED)):
        finished += done
        duration += seconds
        buckets = [a + b for a, b in zip(buckets, counts, strict=True)]
        if status == OperationStatus.FAILED:
            errors[code] = errors.get(code, 0) + n
    return {"buckets": buckets, "finished": finished, "duration_s": duration, "errors": errors}
