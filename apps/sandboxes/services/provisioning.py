"""The cold path: provisioning, destruction and reaping. Called from Celery tasks only."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.core.egress import parse_egress
from apps.sandboxes.agent_client import AgentClient, AgentError, AgentUnreachable, agent_token
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import BackendError, Endpoint, SandboxSpec, StateDivergence
from apps.sandboxes.faults import fault_point
from apps.sandboxes.image_catalog import image_catalog
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.pull_progress import PROGRESS_MIN_INTERVAL_S, merge_progress
from apps.sandboxes.services.lifecycle import sandbox_record_event, sandbox_transition
from apps.sandboxes.services.sandbox_metrics import metrics_history_drop

log = logging.getLogger(__name__)


def sandbox_spec(sandbox: Sandbox) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id=sandbox.id.hex,
        tenant_id=str(sandbox.tenant_id),
        generation=sandbox.generation,
        image=sandbox.image,
        cpu_millis=sandbox.cpu_millis,
        memory_mib=sandbox.memory_mib,
        network_access=sandbox.network_access,
        egress=parse_egress(sandbox.egress),
        agent_token=agent_token(sandbox.id.hex, sandbox.generation),
        disk_mib=settings.HEDGEROW_SANDBOX_DISK_MIB,
        labels=dict(sandbox.labels),
        # the tenant's login for the image's registry, decrypted in memory only
        registry_credentials=image_catalog().credentials_for(sandbox.tenant, sandbox.image),
        snapshot_id=sandbox.snapshot_id.hex if sandbox.snapshot_id else "",
    )


class _ProvisionProgress:
    """The backend's pull events as the sandbox's ``progress`` (the contract's shape),
    written at most every 0.25 s while it is ``provisioning``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox_pk = sandbox.pk
        self.last: dict[str, Any] | None = None
        self.written_at = 0.0

    def __call__(self, event: dict[str, Any]) -> None:
        self.last = merge_progress(event, self.last)
        now = time.monotonic()
        if now - self.written_at < PROGRESS_MIN_INTERVAL_S:
            return
        self.written_at = now
        Sandbox.objects.filter(pk=self.sandbox_pk, state=State.PROVISIONING).update(
            progress=self.last
        )


def wait_agent_healthy(endpoint: Endpoint, token: str, timeout_s: float) -> None:
    """Polls the agent's /health until it answers; the agent is starting, so short backoff."""
    client = AgentClient(endpoint.host, endpoint.port, token)
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            # Short: until the agent listens, the sandbox's egress policy drops the
            # kernel's RST, so a connect hangs for the whole timeout instead of being
            # refused; a long one made every poll cost a second.
            client.health(timeout=0.25)
            return
        except (AgentUnreachable, AgentError) as exc:
            last_error = str(exc)
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    raise BackendError(f"agent not healthy after {timeout_s:.0f}s: {last_error}")


def backend_prepare() -> bool:
    """``Backend.prepare``: True when done. Best effort: a failure is logged, and the
    first provision makes what is missing (and reports its own error)."""
    try:
        get_backend().prepare()
    except Exception:  # never fatal: a provision retries the same steps
        log.exception("the backend's preparation failed; the first provision does it")
        return False
    return True


def provision_claim(sandbox: Sandbox) -> bool:
    """A provision's claim: ``requested`` → ``provisioning`` with a new generation (the
    compare-and-set; False when another claim or a delete moved it first)."""
    return sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED,),
        to_state=State.PROVISIONING,
        reason="scheduled",
        bump_generation=True,
        provisioning_started_at=timezone.now(),
    )


def provision_mark_ready(sandbox: Sandbox, endpoint: Endpoint) -> bool:
    """A provision's end: ``provisioning`` → ``ready`` at the backend's ``endpoint``
    once its agent answered (False when a delete moved it first)."""
    return sandbox_transition(
        sandbox=sandbox,
        from_states=(State.PROVISIONING,),
        to_state=State.READY,
        reason="agent_healthy",
        endpoint_host=endpoint.host,
        endpoint_port=endpoint.port,
        isolation=endpoint.isolation,
        node=endpoint.node,
        ready_at=timezone.now(),
        progress=None,
        # what the backend actually ran (the create's resolve, unless a tag moved since)
        image_digest=endpoint.image_digest or sandbox.image_digest,
    )


def sandbox_provision(*, sandbox_id: str) -> Sandbox | None:
    """Claims a ``requested`` sandbox (CAS → ``provisioning``, new generation), starts it
    on the backend and marks it ``ready`` once its agent answers.

    Idempotent and safe to redeliver: a sandbox already ``provisioning`` (its worker
    died and the task came back) is resumed with the same generation — the backend
    adopts what exists. Any failure destroys what was made and ends in ``failed``.
    """
    sandbox = Sandbox.objects.filter(pk=sandbox_id).first()
    if sandbox is None:
        return None
    claimed = provision_claim(sandbox)
    if not claimed:
        if sandbox.state != State.PROVISIONING:
            return sandbox  # already done, deleted, or failed: nothing to do
        sandbox_record_event(sandbox=sandbox, event="provision_resumed", reason="task_redelivered")
    backend = get_backend()
    spec = sandbox_spec(sandbox)
    try:
        endpoint = backend.provision(spec, _ProvisionProgress(sandbox))
        fault_point("provision.after_backend")
        wait_agent_healthy(endpoint, spec.agent_token, settings.HEDGEROW_READY_TIMEOUT_S)
        if sandbox.snapshot_id is not None:
            # a restore is ready only in the snapshot's state (docs/snapshots.md)
            from apps.sandboxes.services.snapshots import snapshot_verify_child

            diff = snapshot_verify_child(sandbox=sandbox, endpoint=endpoint)
            if diff:
                names = ", ".join(str(d.get("probe") or d.get("service")) for d in diff)
                raise StateDivergence(f"not the snapshot's state: {names}", diff=diff)
    except Exception as exc:  # noqa: BLE001 - any failure must end in `failed`, not stuck
        log.warning("provision of %s failed: %s", sandbox.external_id, exc)
        _destroy_quietly(sandbox)
        diverged = isinstance(exc, StateDivergence)
        extra: dict[str, Any] = {"divergence": exc.diff} if isinstance(exc, StateDivergence) else {}
        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.PROVISIONING,),
            to_state=State.FAILED,
            reason="state_divergence" if diverged else "provision_error",
            message=str(exc)[:1000],
            terminated_at=timezone.now(),
            progress=None,
            **extra,
        )
        return sandbox
    became_ready = provision_mark_ready(sandbox, endpoint)
    if not became_ready and sandbox.state != State.READY:
        # Deleted while we were provisioning: the delete path's destroy may have run
        # before our resources existed, so remove them here too.
        _destroy_quietly(sandbox)
    if became_ready and sandbox.snapshot_id is not None:
        from apps.sandboxes.services.snapshots import snapshot_drop_pause

        snapshot_drop_pause(sandbox=sandbox)  # a resume: its pause is spent
    return sandbox


def sandbox_provision_many(*, sandbox_ids: list[str], threads: int | None = None) -> None:
    """``sandbox_provision`` of each id, on up to ``threads`` threads (default
    ``HEDGEROW_FORK_THREADS``), each taking its ids in turn: a provision mostly waits
    (the zygote's spawn, the agent's first answer, the probes), so a few side by side
    keep the process busy. One child's unexpected error never stops the others (it is
    logged; the reaper's pending deadline ends a child left ``provisioning``)."""
    threads = max(1, min(threads or settings.HEDGEROW_FORK_THREADS, len(sandbox_ids)))
    lanes = [sandbox_ids[i::threads] for i in range(threads)]
    if threads == 1:
        _provision_lane(lanes[0], close=False)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="provision") as pool:
        for future in [pool.submit(_provision_lane, lane, close=True) for lane in lanes]:
            future.result()


def _provision_lane(sandbox_ids: list[str], *, close: bool) -> None:
    try:
        for sandbox_id in sandbox_ids:
            try:
                sandbox_provision(sandbox_id=sandbox_id)
            except Exception:  # the others go on; the reaper ends this one
                log.exception("provision of %s failed outside its own handling", sandbox_id)
    finally:
        if close:  # this thread's database connection is its own
            connection.close()


def _destroy_quietly(sandbox: Sandbox) -> None:
    try:
        get_backend().destroy(sandbox.id.hex)
    except BackendError as exc:
        sandbox_record_event(sandbox=sandbox, event="destroy_error", message=str(exc))


def sandbox_destroy(*, sandbox_id: str) -> Sandbox | None:
    """Removes backend resources of a ``terminating`` sandbox and marks it ``deleted``.

    Idempotent. Also cleans residue of ``failed``/``lost`` sandboxes (state unchanged).
    Raises BackendError on a transient failure so the task retries; the sandbox stays
    ``terminating`` (never silently ``deleted`` with resources left).
    """
    sandbox = Sandbox.objects.filter(pk=sandbox_id).first()
    if sandbox is None or sandbox.state == State.DELETED:
        return sandbox
    get_backend().destroy(sandbox.id.hex)
    metrics_history_drop(sandbox_pk=sandbox.id)  # its kept samples go with it
    if sandbox.state == State.TERMINATING:
        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.TERMINATING,),
            to_state=State.DELETED,
            reason="destroyed",
            terminated_at=timezone.now(),
        )
    from apps.sandboxes.services.snapshots import snapshot_drop_pause

    snapshot_drop_pause(sandbox=sandbox)  # a paused sandbox's state goes with it
    return sandbox


def sandbox_reap(*, now: datetime | None = None) -> dict[str, int]:
    """One pass of every reaper. Each removal is a ledger transition naming its reason.

    * ``ttl_expired``: a ready/provisioning sandbox past ``expires_at``;
    * ``heartbeat_expired``: no heartbeat within ``heartbeat_timeout_s``;
    * ``pending_timeout``: requested/provisioning past the pending deadline (e.g. the
      worker died mid-provision and the task was lost) → ``failed`` and destroyed;
    * stuck ``terminating`` rows get their destroy re-enqueued;
    * ``snapshot_ttl_expired``: snapshots past their ``expires_at`` are deleted.
    """
    from apps.sandboxes.tasks import destroy_sandbox

    now = now or timezone.now()
    counts = {"ttl_expired": 0, "heartbeat_expired": 0, "pending_timeout": 0, "redestroy": 0}
    # Pending first: a sandbox that never became ready failed to start; that is the
    # truer reason even when its TTL has also run out.
    pending_deadline = now - timedelta(seconds=settings.HEDGEROW_PENDING_TIMEOUT_S)
    # Counted from admission (time spent in the admission queue is not pending time).
    for sandbox in Sandbox.objects.annotate(
        pending_since=Coalesce("admitted_at", "created_at")
    ).filter(state__in=(State.REQUESTED, State.PROVISIONING), pending_since__lt=pending_deadline):
        if sandbox_transition(
            sandbox=sandbox,
            from_states=(State.REQUESTED, State.PROVISIONING),
            to_state=State.FAILED,
            reason="pending_timeout",
            actor="reaper",
            message="not ready before the pending deadline",
            terminated_at=now,
        ):
            destroy_sandbox.delay(str(sandbox.id))
            counts["pending_timeout"] += 1
    expiring = (State.READY, State.PROVISIONING, State.REQUESTED, State.PAUSED)
    expired = Sandbox.objects.filter(state__in=expiring, expires_at__lt=now)
    for sandbox in expired:
        if sandbox_transition(
            sandbox=sandbox,
            from_states=expiring,
            to_state=State.TERMINATING,
            reason="ttl_expired",
            actor="reaper",
        ):
            destroy_sandbox.delay(str(sandbox.id))
            counts["ttl_expired"] += 1
    # Only rows whose ``heartbeat_due_at`` (a lower bound on the real deadline) has
    # passed or was never set, by the partial index: a round reads what is due, not
    # every live sandbox (issue 20). The real deadline still decides.
    due = Sandbox.objects.filter(
        Q(heartbeat_due_at__lt=now) | Q(heartbeat_due_at__isnull=True),
        state=State.READY,
        heartbeat_timeout_s__isnull=False,
    )
    for sandbox in due:
        assert sandbox.heartbeat_timeout_s is not None
        last = sandbox.last_heartbeat_at or sandbox.created_at
        deadline = last + timedelta(seconds=sandbox.heartbeat_timeout_s)
        if deadline >= now:
            # Early (it beat since, or was never looked at): not due before its real
            # deadline. Only ever moved later, so a racing heartbeat's value stands.
            Sandbox.objects.filter(
                Q(heartbeat_due_at__lt=deadline) | Q(heartbeat_due_at__isnull=True),
                pk=sandbox.pk,
            ).update(heartbeat_due_at=deadline)
            continue
        if sandbox_transition(
            sandbox=sandbox,
            from_states=(State.READY,),
            to_state=State.TERMINATING,
            reason="heartbeat_expired",
            actor="reaper",
        ):
            destroy_sandbox.delay(str(sandbox.id))
            counts["heartbeat_expired"] += 1
    stuck = Sandbox.objects.filter(
        state=State.TERMINATING, updated_at__lt=now - timedelta(seconds=60)
    )
    for sandbox in stuck:
        destroy_sandbox.delay(str(sandbox.id))
        counts["redestroy"] += 1
    from apps.sandboxes.services.snapshots import snapshot_reap_expired

    counts["snapshot_ttl_expired"] = snapshot_reap_expired(now=now)
    return counts
