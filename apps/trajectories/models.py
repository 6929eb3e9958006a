"""Episodes (one rollout of one task), their steps, the sandboxes they used, and the
audit trail of people relabeling their failure class.

An episode is portable: every field a reader needs lives on the row or its steps,
so an export is readable without the harness's prompt templates or this database's
sandbox rows (those links are kept only as references).
"""

from __future__ import annotations

import secrets
import uuid

from django.db import models
from django.utils import timezone

from apps.sandboxes.models import Operation, Sandbox
from apps.tenancy.models import Tenant


class FailureClass(models.TextChoices):
    STARTUP = "startup"  # a sandbox never became ready
    ENVIRONMENT = "environment"  # sandbox lost, agent unreachable, infra error mid-episode
    OBSERVATION = "observation"  # output truncated/lost before the model saw it
    INFERENCE = "inference"  # the model endpoint failed (client-reported)
    VERIFIER = "verifier"  # the verifier crashed or timed out
    TASK = "task"  # all healthy, the verifier said no: the policy's failure
    SUCCESS = "success"
    UNDETERMINED = "undetermined"  # closed without any verdict (no verifier, no reward)


# Episodes in these classes say nothing about the policy: η counts everything else
# (docs/trajectories.md "Numbers"). ``undetermined`` (no verdict at all) is not a usable
# sample either: counting it as valid overstated η.
INVALID_CLASSES = frozenset(
    {
        FailureClass.STARTUP,
        FailureClass.ENVIRONMENT,
        FailureClass.VERIFIER,
        FailureClass.OBSERVATION,
        FailureClass.UNDETERMINED,
    }
)


class EpisodeStatus(models.TextChoices):
    OPEN = "open"
    CLOSED = "closed"


class VerifierOutcome(models.TextChoices):
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"  # the verifier did not run or crashed: verifier_error
    TIMEOUT = "timeout"


class VerifierKind(models.TextChoices):
    """What ran as the verifier: decides which exit codes are the framework's own
    errors (docs/trajectories.md, "The verifier contract")."""

    PYTEST = "pytest"
    UNITTEST = "unittest"
    GO = "go"
    JEST = "jest"
    JUNIT_XML = "junit-xml"
    CUSTOM = "custom"


TERMINATION_REASONS = (
    "submitted",
    "step_budget",
    "wall_clock",
    "token_budget",
    "agent_gave_up",
    "harness_crash",
    "sandbox_lost",
    "inference_error",
    "verifier_error",
    "cancelled",
)


class StepKind(models.TextChoices):
    EXEC = "exec"  # a command in a sandbox (linked to its Operation)
    MODEL = "model"  # a model call
    TOOL = "tool"  # a tool call that is not an exec
    VERIFIER = "verifier"  # the verifier's own command
    OTHER = "other"


class EpisodeQuerySet(models.QuerySet["Episode"]):
    def for_tenant(self, tenant: Tenant | None) -> EpisodeQuerySet:
        if tenant is None:
            return self.none()
        return self.filter(tenant=tenant)


def new_episode_id() -> str:
    return f"ep-{secrets.token_hex(8)}"


def new_attempt_id() -> str:
    return f"att-{secrets.token_hex(6)}"


class Episode(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="episodes")
    # The id clients see (kept across export/import, unique per tenant).
    episode_id = models.CharField(max_length=64, default=new_episode_id)
    status = models.CharField(
        max_length=8, choices=EpisodeStatus.choices, default=EpisodeStatus.OPEN
    )
    task_id = models.CharField(max_length=200)
    task_version = models.CharField(max_length=100, blank=True)
    image = models.CharField(max_length=200, blank=True)
    image_digest = models.CharField(max_length=100, blank=True)
    initial_state = models.CharField(max_length=200, blank=True)  # id or hash
    model = models.CharField(max_length=200, blank=True)
    model_version = models.CharField(max_length=100, blank=True)
    harness = models.CharField(max_length=200, blank=True)
    harness_version = models.CharField(max_length=100, blank=True)
    policy_version = models.CharField(max_length=200, blank=True)
    attempt_id = models.CharField(max_length=100, default=new_attempt_id)
    sampling = models.JSONField(default=dict, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    termination_reason = models.CharField(max_length=32, blank=True)
    reward = models.FloatField(null=True, blank=True)
    reward_components = models.JSONField(default=dict, blank=True)
    verifier_name = models.CharField(max_length=200, blank=True)
    verifier_version = models.CharField(max_length=100, blank=True)
    verifier_outcome = models.CharField(max_length=16, blank=True)
    inference_error = models.JSONField(null=True, blank=True)  # client-reported
    versions = models.JSONField(default=dict, blank=True)  # client, control_plane, agent
    resources = models.JSONField(default=dict, blank=True)  # totals over steps
    # Total: the episode's share of its sandboxes' full cost + ``client_cost``.
    cost = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    client_cost = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    cost_basis = models.JSONField(default=list, blank=True)  # per sandbox: cost, sharers
    # ``cost`` is final: the episode is closed and every sandbox it used has ended (or it
    # has none here), so its share no longer accrues nor changes with sharers. The
    # numbers read it from the tally instead of recomputing it (services/tally.py).
    cost_final = models.BooleanField(default=False, db_default=False)
    auto_failure_class = models.CharField(max_length=16, blank=True)
    failure_class = models.CharField(max_length=16, blank=True, db_index=True)
    failure_evidence = models.JSONField(default=list, blank=True)
    # An imported episode's class as the exporting installation decided it; the class
    # above is this ledger's where it knows the sandboxes (docs/trajectories.md).
    claimed_class = models.CharField(max_length=16, blank=True)
    imported = models.BooleanField(default=False)
    created_by = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # A branch (docs/snapshots.md): the episode it continues, after which of its steps,
    # and the snapshot its sandbox resumed from.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="branches"
    )
    branch_step = models.PositiveIntegerField(null=True, blank=True)
    branch_snapshot = models.ForeignKey(
        "sandboxes.Snapshot", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Provenance (apps/trajectories/provenance.py): what the client supplied, the
    # components (each a value or "unknown") and the keys derived from them.
    task_hash = models.CharField(max_length=200, blank=True)
    policy_checkpoint = models.CharField(max_length=200, blank=True)
    harness_commit = models.CharField(max_length=200, blank=True)
    verifier_commit = models.CharField(max_length=200, blank=True)
    provenance = models.JSONField(default=dict, blank=True)
    provenance_key = models.CharField(max_length=80, blank=True)
    provenance_origin = models.CharField(max_length=80, blank=True)

    objects = EpisodeQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "episode_id"], name="uniq_episode_tenant_episode_id"
            )
        ]
        indexes = [
            models.Index(fields=["tenant", "task_id"], name="episode_tenant_task"),
            models.Index(fields=["tenant", "started_at"], name="episode_tenant_started"),
            models.Index(fields=["tenant", "provenance_key"], name="episode_tenant_prov_key"),
            models.Index(fields=["tenant", "provenance_origin"], name="episode_tenant_prov_origin"),
            # the closed episodes whose cost is still computed when asked (few: those
            # with a live sandbox, and any the settle sweep has not reached yet)
            models.Index(
                fields=["tenant", "task_id"],
                name="episode_cost_unsettled",
                condition=models.Q(status="closed", cost_final=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.episode_id} ({self.task_id}, {self.failure_class or self.status})"

    @property
    def relabeled(self) -> bool:
        return bool(self.failure_class) and self.failure_class != self.auto_failure_class

    @property
    def is_valid(self) -> bool:
        return self.failure_class not in INVALID_CLASSES


class EpisodeTally(models.Model):
    """The list page's numbers kept as episodes change (issue 20): per tenant, task,
    status and failure class, how many episodes there are, how many of them have a
    final cost and what those cost, and what all of them cost as stored. Written only
    by ``episode_tally_fold`` from the deltas the episode table's trigger appends
    (migration 0010); read with the deltas not folded yet (``selectors.episode_tally``)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    task_id = models.CharField(max_length=200)
    status = models.CharField(max_length=8)
    failure_class = models.CharField(max_length=16, blank=True)
    episodes = models.BigIntegerField(default=0)
    final_episodes = models.BigIntegerField(default=0)
    final_cost = models.DecimalField(max_digits=20, decimal_places=6, default=0)
    # every episode's stored cost (final or as of its last attribution)
    stored_cost = models.DecimalField(max_digits=20, decimal_places=6, default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "task_id", "status", "failure_class"],
                name="uniq_episode_tally_key",
            )
        ]


class EpisodeTallyDelta(models.Model):
    """Append-only: one change to ``EpisodeTally`` (a row each for the old and the new
    version of an episode), written by the trigger in the writer's transaction, so
    writers never wait on each other for a shared tally row."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey(
        Tenant, on_delete=models.CASCADE, related_name="+", db_constraint=False
    )
    task_id = models.CharField(max_length=200)
    status = models.CharField(max_length=8)
    failure_class = models.CharField(max_length=16, blank=True)
    episodes = models.BigIntegerField(default=0)
    final_episodes = models.BigIntegerField(default=0)
    final_cost = models.DecimalField(max_digits=20, decimal_places=6, default=0)
    # every episode's stored cost (final or as of its last attribution)
    stored_cost = models.DecimalField(max_digits=20, decimal_places=6, default=0)


class EpisodeSandbox(models.Model):
    """A sandbox generation an episode ran in. ``sandbox`` is empty for imported
    episodes whose sandboxes live in another installation; the reference stays."""

    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="sandbox_links")
    sandbox = models.ForeignKey(
        Sandbox, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    sandbox_ref = models.CharField(max_length=63)
    generation = models.PositiveIntegerField(null=True, blank=True)
    attached_at = models.DateTimeField(default=timezone.now)
    # Evidence of what the sandbox looked up during the episode (issue 21): the
    # resolver's entries of this generation within the episode's window, captured when
    # the episode closes (the backend's log goes with the sandbox). None: not captured
    # (an imported episode, or one closed before this existed); at most DNS_EVIDENCE_MAX
    # entries, ``dns_log_total`` says how many there were.
    dns_log = models.JSONField(null=True, blank=True)
    dns_log_total = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["attached_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["episode", "sandbox_ref", "generation"], name="uniq_episode_sandbox_gen"
            )
        ]


class Step(models.Model):
    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=StepKind.choices, default=StepKind.EXEC)
    action = models.JSONField(null=True, blank=True)  # raw, as the model produced it
    request = models.JSONField(null=True, blank=True)  # normalized, as executed
    observation = models.JSONField(default=dict, blank=True)  # as returned
    shown = models.JSONField(null=True, blank=True)  # what the model saw, if different
    diff = models.TextField(blank=True)
    model_call = models.JSONField(default=dict, blank=True)  # tokens_in/out, latency_s…
    sandbox_ref = models.CharField(max_length=63, blank=True)
    generation = models.PositiveIntegerField(null=True, blank=True)
    operation_id = models.CharField(max_length=128, blank=True)
    operation_record = models.ForeignKey(
        Operation, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    duration_s = models.FloatField(null=True, blank=True)
    # A verifier step's declaration: {"kind": "pytest", ...} (VerifierKind).
    verifier = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["index"]
        constraints = [
            models.UniqueConstraint(fields=["episode", "index"], name="uniq_step_episode_index")
        ]

    def __str__(self) -> str:
        return f"{self.episode_id}#{self.index} ({self.kind})"


class EpisodeRelabel(models.Model):
    """Append-only: a person changed the failure class. The automatic label stays on
    the episode (``auto_failure_class``)."""

    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="relabels")
    from_class = models.CharField(max_length=16)
    to_class = models.CharField(max_length=16)
    reason = models.TextField()
    actor = models.CharField(max_length=128)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["at", "id"]


class EpisodeReattribution(models.Model):
    """Append-only: the control plane changed a closed episode's automatic class after
    the fact, because something the procedure reads changed (e.g. its task's verifier
    became suspect, or was cleared). ``verdict_class`` is what the verifier's verdict
    (the claim) gave, ``to_class`` what the episode is now attributed; ``evidence`` is
    what caused the change. A person's relabel still wins (``failure_class``)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="reattributions")
    from_class = models.CharField(max_length=16)
    to_class = models.CharField(max_length=16)
    verdict_class = models.CharField(max_length=16, blank=True)
    cause = models.CharField(max_length=64)
    reason = models.TextField()
    evidence = models.JSONField(default=list, blank=True)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["at", "id"]


# -- secrets taken out of the data (apps/trajectories/redaction.py) --------------------


class EpisodeSecret(models.Model):
    """One distinct secret found in an episode and the placeholder that replaced it.
    The value is Fernet-encrypted (``apps/core/crypto.py``: key outside the
    database); ``fingerprint`` (keyed HMAC) finds the same secret again without
    decrypting. Readable only by tenant admins, every read audited (SecretAccess)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="secrets")
    kind = models.CharField(max_length=40)
    placeholder = models.CharField(max_length=80)
    fingerprint = models.CharField(max_length=64)
    value_encrypted = models.TextField()
    first_path = models.CharField(max_length=300, blank=True)  # where it was first seen
    occurrences = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["episode", "fingerprint"], name="uniq_episode_secret_fingerprint"
            ),
            models.UniqueConstraint(
                fields=["episode", "placeholder"], name="uniq_episode_secret_placeholder"
            ),
        ]
        indexes = [models.Index(fields=["tenant", "kind"], name="episode_secret_tenant_kind")]


class SecretAccess(models.Model):
    """Append-only audit: who read which episode's secret values, when."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    episode_ref = models.CharField(max_length=64)  # the episode id (kept after a deletion)
    actor = models.CharField(max_length=128)
    placeholders = models.JSONField(default=list)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["tenant", "at"], name="secret_access_tenant_at")]


# -- lineage: raw events → normalized steps → segments → packed samples -----------------


class RawEvent(models.Model):
    """What the harness sent, as received (after secret redaction), append-only:
    the open, each step batch, the close, an imported line."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="raw_events")
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=16)  # open | steps | close | import
    body = models.JSONField()
    sha256 = models.CharField(max_length=64)  # of the stored body's canonical JSON
    produced = models.JSONField(default=list, blank=True)  # step indexes it wrote
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["seq"]
        constraints = [
            models.UniqueConstraint(fields=["episode", "seq"], name="uniq_raw_event_episode_seq")
        ]


class LayerKind(models.TextChoices):
    NORMALIZED = "normalized"  # steps, with the parser and schema version
    SEGMENTS = "segments"  # step ranges with selection reason, evidence, reward
    PACKED = "packed"  # samples, with the tokenizer and chat template


class LineageLayer(models.Model):
    """One version of one derived layer of an episode, append-only: a new parser
    version is a new layer, the old one stays. ``source`` is the layer it was derived
    from (none for a normalized layer: its items name raw events)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    episode = models.ForeignKey(Episode, on_delete=models.CASCADE, related_name="layers")
    kind = models.CharField(max_length=16, choices=LayerKind.choices)
    version = models.PositiveIntegerField()  # per (episode, kind): 1, 2, …
    source = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="derived"
    )
    producer = models.CharField(max_length=200)  # parser / segmenter / packer name
    producer_version = models.CharField(max_length=100)
    schema_version = models.CharField(max_length=100, blank=True)
    # packed: {"tokenizer": id, "chat_template": id, …}, as the client supplied them
    params = models.JSONField(default=dict, blank=True)
    created_by = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["kind", "version"]
        constraints = [
            models.UniqueConstraint(
                fields=["episode", "kind", "version"], name="uniq_layer_episode_kind_version"
            )
        ]


class LayerItem(models.Model):
    """One normalized step, segment or packed sample. ``sources`` names what it came
    from in the layer below: raw event seqs (normalized), a step range ``[first,
    last]`` of the source layer (segments), segment positions (packed)."""

    layer = models.ForeignKey(LineageLayer, on_delete=models.CASCADE, related_name="items")
    position = models.PositiveIntegerField()
    sources = models.JSONField(default=list)
    data = models.JSONField(null=True, blank=True)
    selection_reason = models.CharField(max_length=200, blank=True)  # segments
    evidence = models.JSONField(default=dict, blank=True)  # segments
    reward = models.FloatField(null=True, blank=True)  # segments

    class Meta:
        ordering = ["position"]
        constraints = [
            models.UniqueConstraint(fields=["layer", "position"], name="uniq_layer_item_position")
        ]


class LineageExport(models.Model):
    """An export that was handed out: which episodes it held (a deletion lists it)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    kind = models.CharField(max_length=32, default="episodes.jsonl")
    actor = models.CharField(max_length=128, blank=True)
    filters = models.JSONField(default=dict, blank=True)
    episode_ids = models.JSONField(default=list)  # client-visible episode ids
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]


class Tombstone(models.Model):
    """What a deletion request removed (episodes with their provenance keys, raw events,
    layers and items) and what it affects (exports, and whatever the registered
    dependents — datasets, analyses — reported). The data itself is gone."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    request = models.JSONField(default=dict)  # {"task_id": …} | {"episode_ids": …} | …
    reason = models.TextField()
    actor = models.CharField(max_length=128)
    removed = models.JSONField(default=dict)
    affects = models.JSONField(default=list)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at"]
