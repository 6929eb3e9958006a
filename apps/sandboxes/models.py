"""Sandboxes as a state machine, their append-only lifecycle ledger, and operations."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django.utils import timezone

from apps.tenancy.models import Tenant


class State(models.TextChoices):
    QUEUED = "queued"  # waiting in the admission queue; holds no resources, not billed
    REQUESTED = "requested"
    PROVISIONING = "provisioning"
    READY = "ready"
    # its state captured as a snapshot and its compute released; ``resume`` restores it
    # under the same id with generation + 1 (docs/snapshots.md)
    PAUSED = "paused"
    TERMINATING = "terminating"
    DELETED = "deleted"
    FAILED = "failed"  # never became ready
    LOST = "lost"  # was ready; the backend resource vanished


LIVE_STATES = (State.REQUESTED, State.PROVISIONING, State.READY, State.TERMINATING)
FINAL_STATES = (State.DELETED, State.FAILED, State.LOST)


def egress_default() -> str:
    return "none"


class SandboxQuerySet(models.QuerySet["Sandbox"]):
    def for_tenant(self, tenant: Tenant | None) -> SandboxQuerySet:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)


class Sandbox(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: every unique constraint below starts with the tenant, and a
    # transition (never a HOT update: the state is indexed) writes one entry per index.
    tenant = models.ForeignKey(
        Tenant, on_delete=models.PROTECT, related_name="sandboxes", db_index=False
    )
    # The id clients see and may choose. Never used as a backend or Redis key (the UUID
    # is), so a client id like "all" cannot collide with anything internal.
    external_id = models.CharField(max_length=63)
    state = models.CharField(max_length=16, choices=State.choices, default=State.REQUESTED)
    generation = models.PositiveIntegerField(default=0)
    image = models.CharField(max_length=200)
    # The manifest digest the image resolved to at create (then the one the backend ran):
    # exactly what the sandbox is. "" for ``host``.
    image_digest = models.CharField(max_length=80, blank=True)
    # The image pull's progress while ``provisioning`` ({"phase","layers","bytes",
    # "total"}), else null.
    progress = models.JSONField(null=True, blank=True)
    cpu_millis = models.PositiveIntegerField()
    memory_mib = models.PositiveIntegerField()
    # Routed at all: true for egress "all" and for an allowlist (kept for the warm pool's
    # shapes and old clients; ``egress`` is the policy).
    network_access = models.BooleanField(default=False)
    # The egress policy in canonical form (apps/core/egress.py): "none",
    # "all" or {"allow": [...], "dns": "filtered"}.
    egress = models.JSONField(default=egress_default)
    labels = models.JSONField(default=dict, blank=True)
    ttl_seconds = models.PositiveIntegerField()
    expires_at = models.DateTimeField()
    heartbeat_timeout_s = models.PositiveIntegerField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # When the heartbeat reaper next has to look at this sandbox: never later than its
    # real deadline (``last_heartbeat_at or created_at`` + ``heartbeat_timeout_s``), so
    # the reaper reads only rows whose ``heartbeat_due_at`` has passed (or is unset) by
    # the partial index below. A heartbeat moves it only when it is within half a
    # timeout of now, so most heartbeats leave every indexed column alone (a HOT
    # update); the reaper moves it up to the real deadline when it finds one early.
    heartbeat_due_at = models.DateTimeField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=128, null=True, blank=True)
    request_hash = models.CharField(max_length=64, blank=True)
    backend = models.CharField(max_length=32)
    isolation = models.CharField(max_length=32, blank=True)
    endpoint_host = models.CharField(max_length=64, blank=True)
    endpoint_port = models.PositiveIntegerField(null=True, blank=True)
    node = models.CharField(max_length=128, blank=True)
    status_message = models.TextField(blank=True)
    created_by = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    # When admission let it start (at create, or later out of the queue). Pending
    # deadlines count from here, so time spent queued never fails a sandbox.
    admitted_at = models.DateTimeField(null=True, blank=True)
    provisioning_started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    terminated_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Restored from this snapshot (a fork child or a create ``from_snapshot``): ready
    # only once its state matched the snapshot's fingerprint; else ``failed`` with
    # reason ``state_divergence`` and the diff in ``divergence``.
    snapshot = models.ForeignKey(
        "Snapshot", null=True, blank=True, on_delete=models.PROTECT, related_name="children"
    )
    divergence = models.JSONField(null=True, blank=True)
    # How far retention has thinned an ended sandbox's operations (services/retention.py,
    # docs/operations.md "Retention"): RETENTION_FULL, RETENTION_OUTPUT_PRUNED, or
    # RETENTION_SUMMARIZED (its operation rows replaced by ``OperationSummary`` rows).
    # Never written by a transition; only the retention job moves it forward.
    retention = models.PositiveSmallIntegerField(default=0, db_default=0)

    objects = SandboxQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "external_id"], name="uniq_sandbox_tenant_external_id"
            ),
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="uniq_sandbox_tenant_idempotency_key",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "expires_at"], name="sandbox_state_expiry"),
            # The heartbeat reaper's read (issue 20): ready sandboxes with a heartbeat
            # timeout, by when they are next due, so a round reads what is due.
            models.Index(
                fields=["heartbeat_due_at"],
                name="sandbox_heartbeat_due",
                condition=Q(state="ready", heartbeat_timeout_s__isnull=False),
            ),
            # What retention still has to thin, oldest end first: only ended sandboxes
            # not yet summarized have an entry, so a live sandbox's transitions never
            # write to it and the job's read is bounded by what is due, not by history.
            models.Index(
                fields=["retention", "updated_at"],
                name="sandbox_retention_due",
                condition=Q(state__in=("deleted", "failed", "lost"), retention__lt=2),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.external_id} ({self.state})"

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES


class SandboxEvent(models.Model):
    """The lifecycle ledger: append-only; one row per transition or notable fact."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.PROTECT, related_name="events")
    # Indexed by ``sandboxevent_tenant_at`` (tenant first): a second index on the tenant
    # alone was one more entry to write per ledger row (five per sandbox).
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+", db_index=False)
    at = models.DateTimeField(default=timezone.now, db_index=True)
    event = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16, blank=True)
    reason = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)
    actor = models.CharField(max_length=128, blank=True)
    generation = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["tenant", "at"], name="sandboxevent_tenant_at")]

    def __str__(self) -> str:
        return f"{self.sandbox_id} {self.from_state}->{self.to_state} ({self.reason})"


class OperationStatus(models.TextChoices):
    RUNNING = "running"
    COMPLETED = "completed"  # the command ran and ended (any exit, signal, timeout)
    FAILED = "failed"  # the agent could not run it or could not be reached


class OperationQuerySet(models.QuerySet["Operation"]):
    def for_tenant(self, tenant: Tenant | None) -> OperationQuerySet:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)


class Operation(models.Model):
    """One exec (or patch) in a sandbox. Unique per (sandbox, operation_id): a replay
    finds this row instead of running the command again."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    # indexed by the unique key, which starts with the sandbox
    sandbox = models.ForeignKey(
        Sandbox, on_delete=models.PROTECT, related_name="operations", db_index=False
    )
    operation_id = models.CharField(max_length=128)
    kind = models.CharField(max_length=16, default="exec")
    generation = models.PositiveIntegerField()
    request = models.JSONField(default=dict)
    request_hash = models.CharField(max_length=64)
    status = models.CharField(
        max_length=16, choices=OperationStatus.choices, default=OperationStatus.RUNNING
    )
    termination = models.CharField(max_length=16, blank=True)  # exited|signaled|timeout|…
    exit_code = models.IntegerField(null=True, blank=True)
    signal = models.IntegerField(null=True, blank=True)
    stdout = models.JSONField(default=dict, blank=True)
    stderr = models.JSONField(default=dict, blank=True)
    usage = models.JSONField(default=dict, blank=True)
    children_remained = models.BooleanField(default=False)
    error = models.JSONField(null=True, blank=True)
    actor = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = OperationQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["sandbox", "operation_id"], name="uniq_operation_sandbox_operation_id"
            )
        ]
        # No index covers a column the result's UPDATE writes (``RESULT_COLUMNS``:
        # status, finished_at, output…), so that UPDATE is a HOT update (migration
        # 0016: no new index entries, the new row version on the same page, which
        # the table's fillfactor leaves room for). The recovery sweep finds rows
        # still running by ``created_at`` from its watermark instead of by status.

    def __str__(self) -> str:
        return f"{self.operation_id} ({self.status})"


# Upper bounds (seconds) of the exec duration histogram (``/metrics``); summaries keep
# their counts so the histogram never shrinks when retention deletes operation rows.
EXEC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0)

RETENTION_FULL = 0
RETENTION_OUTPUT_PRUNED = 1
RETENTION_SUMMARIZED = 2


class OperationSummary(models.Model):
    """What retention keeps of an ended sandbox's deleted operation rows: counts per
    (sandbox, kind, status, error code), the duration sum and the duration histogram
    (cumulative counts per ``EXEC_BUCKETS`` bound, over finished operations), and the
    first and last creation time. The metrics add these to the live rows, so counters
    stay monotonic across pruning."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+", db_index=False)
    # indexed by the unique key, which starts with the sandbox
    sandbox = models.ForeignKey(Sandbox, on_delete=models.PROTECT, related_name="+", db_index=False)
    kind = models.CharField(max_length=16)
    status = models.CharField(max_length=16)
    error_code = models.CharField(max_length=64, blank=True)
    count = models.PositiveIntegerField(default=0)
    finished = models.PositiveIntegerField(default=0)
    duration_s = models.FloatField(default=0.0)
    buckets = models.JSONField(default=list)  # cumulative, one count per EXEC_BUCKETS bound
    first_at = models.DateTimeField()
    last_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["sandbox", "kind", "status", "error_code"],
                name="uniq_operationsummary_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.sandbox_id} {self.kind}/{self.status}: {self.count}"


class MetricsFold(models.Model):
    """What ``/metrics`` has already counted of an append-only history (the lifecycle
    ledger's automatic actions, the reconciler's rounds): ``counts`` over the rows
    stamped before ``through``. A scrape adds the rows stamped since and moves
    ``through`` up to a few minutes ago (``services/metrics_fold.py``), so it reads
    what happened since the last scrape, not the whole history. The operation
    recovery sweep keeps its watermark the same way (``services/recovery.py``,
    ``RECOVERY_MARK``)."""

    name = models.CharField(max_length=64, primary_key=True)
    through = models.DateTimeField()
    counts = models.JSONField(default=dict)

    def __str__(self) -> str:
        return f"{self.name} through {self.through:%Y-%m-%d %H:%M:%S}"


class MetricsDelta(models.Model):
    """A change to a tally ``/metrics`` reports (sandboxes by state and tenant, the
    create-to-ready and exec histograms, failed operations by code), written by
    Postgres triggers on the sandbox, operation and operation summary rows (migration
    0015) in the writer's own transaction, so the tally is exact whatever wrote the
    row. Insert-only: writers never wait on each other. A scrape moves the committed
    deltas into the ``tallies`` fold (``services/metrics_tally.py``), so it reads what
    changed since the last one, not every row."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=16)  # sandboxes | ready | exec | errors
    key = models.CharField(max_length=200)
    n = models.BigIntegerField()
    total = models.DecimalField(max_digits=30, decimal_places=6)  # seconds (histograms)

    def __str__(self) -> str:
        return f"{self.name} {self.key}: {self.n:+d}"


class ReconcileRun(models.Model):
    """One reconciler round: what the backend listed and what was done about it."""

    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    backend = models.CharField(max_length=32)
    # A round is skipped when the inventory could not be listed completely (never act
    # on a partial view) or another reconciler holds the lock.
    skipped = models.BooleanField(default=False)
    skip_reason = models.CharField(max_length=200, blank=True)
    inventory_items = models.PositiveIntegerField(default=0)
    actions = models.JSONField(default=dict, blank=True)  # reason -> count
    details = models.JSONField(default=list, blank=True)  # [{sandbox_id, action, kinds}]

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"reconcile {self.started_at:%Y-%m-%d %H:%M:%S} {self.actions}"


class AuditStatus(models.TextChoices):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class AuditRun(models.Model):
    """A stored reclaim-leak audit: the equation's terms for one period and slice."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    # Empty values mean "all"; the tenant is also a column so a tenant's history is a
    # cheap indexed read for the dashboard.
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    image = models.CharField(max_length=200, blank=True)
    node = models.CharField(max_length=128, blank=True)
    backend = models.CharField(max_length=32, blank=True)
    trigger = models.CharField(max_length=16, default="manual")  # scheduled | manual
    created = models.PositiveIntegerField(default=0)
    deleted = models.PositiveIntegerField(default=0)
    reaped_ttl = models.PositiveIntegerField(default=0)
    reaped_heartbeat = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    lost = models.PositiveIntegerField(default=0)
    live = models.PositiveIntegerField(default=0)
    leaked = models.PositiveIntegerField(default=0)
    orphaned = models.PositiveIntegerField(default=0)
    balanced = models.BooleanField(default=True)
    ttl_share = models.FloatField(default=0.0)
    reclaimed = models.PositiveIntegerField(default=0)
    report = models.JSONField(default=dict, blank=True)
    # A team's own audit is computed by a worker: ``running`` until it is stored.
    status = models.CharField(max_length=16, choices=AuditStatus.choices, default="done")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="auditrun_tenant_created")]

    def __str__(self) -> str:
        return f"audit {self.created_at:%Y-%m-%d %H:%M} leaked={self.leaked}"


class WarmMemberState(models.TextChoices):
    WARMING = "warming"  # row written, the backend is starting it
    WARM = "warm"  # its agent answered /health: ready to be claimed


class WarmMember(models.Model):
    """A started sandbox that belongs to no tenant yet (the warm pool).

    Its id is the UUID the backend's resources are named after; a create that claims it
    becomes a ``Sandbox`` with this very id and generation, so the agent token (derived
    from both) is the one the running agent already holds. The row is removed in the
    claiming transaction, so a member is either here or a sandbox record, never both.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    backend = models.CharField(max_length=32)
    # The shape: what the backend bakes in at provision (a claim must match it exactly).
    image = models.CharField(max_length=200)
    cpu_millis = models.PositiveIntegerField()
    memory_mib = models.PositiveIntegerField()
    network_access = models.BooleanField(default=False)
    state = models.CharField(
        max_length=16, choices=WarmMemberState.choices, default=WarmMemberState.WARMING
    )
    generation = models.PositiveIntegerField(default=1)
    endpoint_host = models.CharField(max_length=64, blank=True)
    endpoint_port = models.PositiveIntegerField(null=True, blank=True)
    isolation = models.CharField(max_length=32, blank=True)
    node = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    warm_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["image", "cpu_millis", "memory_mib", "network_access", "state", "warm_at"],
                name="warmmember_shape_state",
            )
        ]

    def __str__(self) -> str:
        return f"warm {self.image}/{self.cpu_millis}m/{self.memory_mib}Mi ({self.state})"


class SnapshotState(models.TextChoices):
    CAPTURING = "capturing"
    READY = "ready"
    FAILED = "failed"  # the capture did not complete: nothing of it exists
    DELETED = "deleted"


class SnapshotQuerySet(models.QuerySet["Snapshot"]):
    def for_tenant(self, tenant: Tenant | None) -> SnapshotQuerySet:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)


class Snapshot(models.Model):
    """A sandbox's filesystem state (writable root, /workspace, /tmp) captured on its
    backend, with the client's manifest and the fingerprint a restore must match
    (docs/snapshots.md)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    sandbox = models.ForeignKey(Sandbox, on_delete=models.PROTECT, related_name="snapshots")
    # the snapshot the captured sandbox was itself restored from (a branch of a branch)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    name = models.CharField(max_length=128, blank=True)
    # "snapshot": the client's; "pause": what ``pause`` captured for ``resume``
    kind = models.CharField(max_length=16, default="snapshot")
    state = models.CharField(
        max_length=16, choices=SnapshotState.choices, default=SnapshotState.CAPTURING
    )
    backend = models.CharField(max_length=32)
    image = models.CharField(max_length=200)
    image_digest = models.CharField(max_length=80, blank=True)
    generation = models.PositiveIntegerField(default=0)  # the sandbox's, at capture
    # the client's: cognitive state (messages, tool schema, model, sampling, seeds),
    # services to restart; stored as given
    manifest = models.JSONField(default=dict, blank=True)
    # [{"name", "command", "volatile", "timeout"}]: read-only commands run at capture
    # and on every restored child
    probes = models.JSONField(default=list, blank=True)
    # {"tree": "sha256:…", "files": n, "probes": {name: {"exit_code", "stdout"}}}
    fingerprint = models.JSONField(default=dict, blank=True)
    size_bytes = models.BigIntegerField(default=0)
    capture_s = models.FloatField(null=True, blank=True)  # how long it was frozen
    # the capture's whole cost (quiesce, probes, snapshot, tree hash): C_s of branch advice
    capture_wall_s = models.FloatField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)  # {"code", "message"} when failed
    ttl_seconds = models.PositiveIntegerField()
    expires_at = models.DateTimeField()
    created_by = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    captured_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    deleted_reason = models.CharField(max_length=32, blank=True)  # deleted | ttl_expired

    objects = SnapshotQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["state", "expires_at"], name="snapshot_state_expiry"),
            # the minutely storage sweep's look-back (metering/storage.py)
            models.Index(
                fields=["captured_at"],
                name="snapshot_captured",
                condition=models.Q(captured_at__isnull=False),
            ),
            models.Index(
                fields=["deleted_at"],
                name="snapshot_deleted",
                condition=models.Q(deleted_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"snapshot {self.id} of {self.sandbox_id} ({self.state})"
