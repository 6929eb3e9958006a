"""Operations whose answer went missing: the web process died mid-exec, or the agent's
response was lost on the way back.

The agent keys every command by operation id and keeps its result, so the control
plane can always ask it what happened instead of guessing; only when the agent cannot
know (sandbox gone, agent restarted) does an operation end ``interrupted``-style
(``failed`` with a typed code), never stuck ``running``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from apps.sandboxes.agent_client import AgentError, AgentUnreachable
from apps.sandboxes.models import MetricsFold, Operation, OperationStatus, Sandbox, State
from apps.sandboxes.services.operations import agent_for, result_fields

log = logging.getLogger(__name__)

# Failures that may hide a command which did run: the answer, not the command, was lost.
ANSWER_LOST_CODES = ("agent_unreachable",)


def operation_recover_answer(*, operation: Operation, sandbox: Sandbox) -> Operation:
    """For an operation stored ``failed`` because the agent's answer never arrived:
    asks the agent by operation id and, if the command finished, stores its real
    result (compare-and-set from that exact failure, so it happens at most once).

    Never runs the command again. Leaves the row unchanged when the agent does not
    know the id, is unreachable, or the sandbox moved on.
    """
    error = operation.error or {}
    if operation.status != OperationStatus.FAILED or error.get("code") not in ANSWER_LOST_CODES:
        return operation
    if sandbox.state != State.READY or sandbox.generation != operation.generation:
        return operation
    try:
        result = agent_for(sandbox).operation(operation.operation_id, wait=0)
    except (AgentUnreachable, AgentError):
        return operation
    if result.get("status") == "running" or not result.get("termination"):
        return operation
    fields = result_fields(result)
    changed = Operation.objects.filter(
        pk=operation.pk, status=OperationStatus.FAILED, error__code=error.get("code")
    ).update(**fields)
    if changed:
        log.info(
            "recovered the lost answer of %s from the agent",
            operation.operation_id,
            extra={"operation_id": operation.operation_id, "event": "operation_recovered"},
        )
    operation.refresh_from_db()
    return operation


# The sweep's watermark (a ``MetricsFold`` row): no operation created before
# ``through`` minus the margin is still ``running``, except the ones listed in
# ``counts["running"]`` (long commands a live process still relays).
RECOVERY_MARK = "operation_recovery"


def operation_recover_stale(*, now: datetime | None = None, limit: int = 500) -> dict[str, int]:
    """The periodic sweep: every operation still ``running`` after
    ``HEDGEROW_OPERATION_RECOVERY_AFTER_S`` goes through the streaming layer's
    ``operation_recover`` (which leaves alone anything a live process still relays,
    records a finished result from the agent, re-attaches a running command, or ends
    it typed when the sandbox is gone). Returns counts by resulting status.

    No index covers ``status`` (the result's UPDATE stays HOT: migration 0016), so the
    sweep reads the ``created_at`` index from where the last sweep got to
    (``RECOVERY_MARK``), less a margin of two recovery delays for a row stamped before
    it became visible, plus the rows it left running last time by primary key: the
    rows it reads follow the execs since the last sweep, not the table's size. The
    first sweep (no mark yet) reads every row older than the cutoff once."""
    from apps.sandboxes.services.streaming import operation_recover

    clock = timezone.now()
    now = now or clock
    after = timedelta(seconds=settings.HEDGEROW_OPERATION_RECOVERY_AFTER_S)
    margin = 2 * after
    cutoff = now - after
    mark = MetricsFold.objects.filter(name=RECOVERY_MARK).first()
    carried: list[str] = list(mark.counts.get("running", [])) if mark is not None else []
    window = Q(created_at__lt=cutoff)
    if mark is not None:
        window &= Q(created_at__gte=mark.through - margin) | Q(pk__in=carried)
    stale = list(
        Operation.objects.filter(window, status=OperationStatus.RUNNING)
        .select_related("sandbox")
        .order_by("created_at")[:limit]
    )
    counts: dict[str, int] = {}
    for operation in stale:
        try:
            recovered = operation_recover(operation=operation)
        except Exception:  # one bad row must not stop the sweep
            log.exception("recovery of %s failed", operation.operation_id)
            continue
        counts[recovered.status] = counts.get(recovered.status, 0) + 1
    # Never past the real clock (a caller's ``now`` may be ahead of it, as in tests):
    # rows stamped from now on must still fall in a later sweep's window.
    through = min(cutoff, clock - after)
    if len(stale) == limit:
        through = min(through, stale[-1].created_at)  # the rest next time
    candidates = {*carried, *(str(operation.pk) for operation in stale)}
    running = sorted(
        str(pk)
        for pk in Operation.objects.filter(
            pk__in=candidates, status=OperationStatus.RUNNING
        ).values_list("pk", flat=True)
    )
    MetricsFold.objects.update_or_create(
        name=RECOVERY_MARK, defaults={"through": through, "counts": {"running": running}}
    )
    return counts
