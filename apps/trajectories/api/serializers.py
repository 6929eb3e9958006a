from __future__ import annotations

from decimal import Decimal
from typing import Any

from rest_framework import serializers

from apps.sandboxes.api.serializers import SandboxEventSerializer
from apps.trajectories.models import (
    TERMINATION_REASONS,
    Episode,
    EpisodeRelabel,
    FailureClass,
    Step,
    StepKind,
    VerifierKind,
    VerifierOutcome,
)
from apps.trajectories.services.episodes import EpisodeResult, StepInput
from apps.trajectories.services.junit import MAX_REPORT_BYTES


class EpisodeOpenSerializer(serializers.Serializer):  # type: ignore[type-arg]
    episode_id = serializers.RegexField(r"^[A-Za-z0-9._:-]{1,64}$", required=False)
    task_id = serializers.CharField(max_length=200)
    task_version = serializers.CharField(max_length=100, required=False, allow_blank=True)
    image = serializers.CharField(max_length=200, required=False, allow_blank=True)
    image_digest = serializers.CharField(max_length=100, required=False, allow_blank=True)
    initial_state = serializers.CharField(max_length=200, required=False, allow_blank=True)
    model = serializers.CharField(max_length=200, required=False, allow_blank=True)
    model_version = serializers.CharField(max_length=100, required=False, allow_blank=True)
    harness = serializers.CharField(max_length=200, required=False, allow_blank=True)
    harness_version = serializers.CharField(max_length=100, required=False, allow_blank=True)
    policy_version = serializers.CharField(max_length=200, required=False, allow_blank=True)
    attempt_id = serializers.CharField(max_length=100, required=False)
    sampling = serializers.DictField(required=False)
    labels = serializers.DictField(child=serializers.CharField(max_length=253), required=False)
    versions = serializers.DictField(child=serializers.CharField(max_length=100), required=False)
    sandbox_ids = serializers.ListField(
        child=serializers.CharField(max_length=63), required=False, max_length=64
    )
    started_at = serializers.DateTimeField(required=False)
    task_hash = serializers.CharField(
        max_length=200, required=False, allow_blank=True, help_text="the task's content hash"
    )
    policy_checkpoint = serializers.CharField(max_length=200, required=False, allow_blank=True)
    harness_commit = serializers.CharField(max_length=200, required=False, allow_blank=True)
    verifier_commit = serializers.CharField(max_length=200, required=False, allow_blank=True)
    parent_episode_id = serializers.CharField(
        max_length=64, required=False, help_text="a branch: the episode it continues"
    )
    branch_step = serializers.IntegerField(
        min_value=0, required=False, help_text="the parent's step it continues after"
    )
    from_snapshot = serializers.CharField(
        max_length=64,
        required=False,
        help_text="the snapshot it resumed from (default: the first sandbox's)",
    )

    BRANCH = ("parent_episode_id", "branch_step", "from_snapshot")

    def episode_fields(self) -> dict[str, Any]:
        skip = {"episode_id", "sandbox_ids", "started_at", *self.BRANCH}
        return {k: v for k, v in self.validated_data.items() if k not in skip}

    def branch(self) -> dict[str, Any] | None:
        data = self.validated_data
        if "parent_episode_id" not in data:
            if "branch_step" in data or "from_snapshot" in data:
                raise serializers.ValidationError(
                    {"parent_episode_id": "a branch names the episode it continues"}
                )
            return None
        return {
            "parent_episode_id": data["parent_episode_id"],
            "step": data.get("branch_step"),
            "snapshot_id": data.get("from_snapshot"),
        }


class VerifierDeclarationSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """A verifier step's declaration: which framework ran (docs/trajectories.md)."""

    kind = serializers.ChoiceField(choices=VerifierKind.choices)
    # A structured report (JUnit XML) the verifier wrote, as read from the sandbox:
    # parsed into the step's per-test results; empty = the verifier wrote none.
    report = serializers.CharField(
        required=False, allow_blank=True, trim_whitespace=False, max_length=MAX_REPORT_BYTES
    )
    report_path = serializers.CharField(required=False, allow_blank=True, max_length=1000)


class StepInputSerializer(serializers.Serializer):  # type: ignore[type-arg]
    kind = serializers.ChoiceField(choices=StepKind.choices, default=StepKind.EXEC)
    index = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)  # int4
    action = serializers.JSONField(required=False, allow_null=True)
    request = serializers.JSONField(required=False, allow_null=True)
    observation = serializers.DictField(required=False, allow_null=True)
    shown = serializers.JSONField(required=False, allow_null=True)
    diff = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)
    model_call = serializers.DictField(required=False)
    sandbox_id = serializers.CharField(max_length=63, required=False, allow_blank=True)
    operation_id = serializers.CharField(max_length=128, required=False, allow_blank=True)
    started_at = serializers.DateTimeField(required=False, allow_null=True)
    ended_at = serializers.DateTimeField(required=False, allow_null=True)
    duration_s = serializers.FloatField(required=False, allow_null=True, min_value=0)
    verifier = VerifierDeclarationSerializer(required=False)

    def to_input(self, data: dict[str, Any]) -> StepInput:
        return StepInput(**{k: v for k, v in data.items() if v is not None or k == "action"})


class StepAppendSerializer(serializers.Serializer):  # type: ignore[type-arg]
    steps = StepInputSerializer(many=True, allow_empty=False)

    def validate_steps(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(value) > 1000:
            raise serializers.ValidationError("at most 1000 steps per call", code="too_many")
        return value

    def to_inputs(self) -> list[StepInput]:
        item = StepInputSerializer()
        return [item.to_input(data) for data in self.validated_data["steps"]]


class EpisodeCloseSerializer(serializers.Serializer):  # type: ignore[type-arg]
    termination_reason = serializers.ChoiceField(
        choices=[(r, r) for r in TERMINATION_REASONS], required=False, allow_blank=True
    )
    reward = serializers.FloatField(required=False, allow_null=True)
    reward_components = serializers.DictField(required=False)
    verifier_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    verifier_version = serializers.CharField(max_length=100, required=False, allow_blank=True)
    verifier_outcome = serializers.ChoiceField(
        choices=VerifierOutcome.choices, required=False, allow_blank=True
    )
    inference_error = serializers.JSONField(required=False, allow_null=True)
    ended_at = serializers.DateTimeField(required=False, allow_null=True)
    client_cost = serializers.DecimalField(
        max_digits=14, decimal_places=6, min_value=Decimal(0), required=False
    )

    def to_result(self) -> EpisodeResult:
        return EpisodeResult(**{k: v for k, v in self.validated_data.items() if v is not None})


class RelabelSerializer(serializers.Serializer):  # type: ignore[type-arg]
    failure_class = serializers.ChoiceField(choices=FailureClass.choices)
    reason = serializers.CharField(max_length=10000)


class RelabelRecordSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = EpisodeRelabel
        fields = ["from_class", "to_class", "reason", "actor", "at"]


class StepSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    sandbox_id = serializers.CharField(source="sandbox_ref")

    class Meta:
        model = Step
        fields = [
            "index",
            "kind",
            "action",
            "request",
            "observation",
            "shown",
            "diff",
            "model_call",
            "sandbox_id",
            "generation",
            "operation_id",
            "started_at",
            "ended_at",
            "duration_s",
            "verifier",
        ]


class EpisodeSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    id = serializers.CharField(source="episode_id")
    valid = serializers.BooleanField(source="is_valid")
    relabeled = serializers.SerializerMethodField()
    sandboxes = serializers.SerializerMethodField()
    cost = serializers.DecimalField(max_digits=14, decimal_places=6, coerce_to_string=True)
    client_cost = serializers.DecimalField(max_digits=14, decimal_places=6, coerce_to_string=True)

    class Meta:
        model = Episode
        fields = [
            "id",
            "status",
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
            "started_at",
            "ended_at",
            "termination_reason",
            "reward",
            "reward_components",
            "verifier_name",
            "verifier_version",
            "verifier_outcome",
            "inference_error",
            "versions",
            "resources",
            "cost",
            "client_cost",
            "cost_basis",
            "failure_class",
            "auto_failure_class",
            "claimed_class",
            "failure_evidence",
            "valid",
            "relabeled",
            "reattributions",
            "imported",
            "sandboxes",
            "parent",
            "branch_step",
            "branch_snapshot",
            "task_hash",
            "policy_checkpoint",
            "harness_commit",
            "verifier_commit",
            "provenance",
        ]

    parent = serializers.SerializerMethodField(  # type: ignore[assignment]
        help_text="the episode this one branches from (its id), else null"
    )
    branch_snapshot = serializers.SerializerMethodField(
        help_text="the snapshot the branch resumed from, else null"
    )

    provenance = serializers.SerializerMethodField(
        help_text="{key, origin, components}: the provenance key, the key without the "
        "attempt, and each component (a value, `unknown` or `none`)"
    )

    def get_provenance(self, obj: Episode) -> dict[str, Any]:
        return {
            "key": obj.provenance_key,
            "origin": obj.provenance_origin,
            "components": obj.provenance,
        }

    def get_parent(self, obj: Episode) -> str | None:
        return obj.parent.episode_id if obj.parent_id else None  # type: ignore[union-attr]

    def get_branch_snapshot(self, obj: Episode) -> str | None:
        return str(obj.branch_snapshot_id) if obj.branch_snapshot_id else None

    def get_relabeled(self, obj: Episode) -> bool:
        return obj.relabels.exists()

    reattributions = serializers.SerializerMethodField(
        help_text="the control plane's later changes of the automatic class (e.g. the "
        "task's verifier became suspect): from_class, to_class, verdict_class, cause, "
        "reason, evidence, at"
    )

    def get_reattributions(self, obj: Episode) -> list[dict[str, Any]]:
        return [
            {
                "from_class": r.from_class,
                "to_class": r.to_class,
                "verdict_class": r.verdict_class,
                "cause": r.cause,
                "reason": r.reason,
                "evidence": r.evidence,
                "at": r.at.isoformat(),
            }
            for r in obj.reattributions.all()
            if r.tenant_id == obj.tenant_id
        ]

    def get_sandboxes(self, obj: Episode) -> list[dict[str, Any]]:
        return [
            {
                "sandbox_id": link.sandbox_ref,
                "generation": link.generation,
                "dns_log": link.dns_log,
                "dns_log_total": link.dns_log_total,
            }
            for link in obj.sandbox_links.all()
        ]


class TimelineItemSerializer(serializers.Serializer):  # type: ignore[type-arg]
    def to_representation(self, instance: dict[str, Any]) -> dict[str, Any]:
        if instance["type"] == "step":
            return {"type": "step", "at": instance["at"], **StepSerializer(instance["step"]).data}
        return {
            "type": "event",
            "sandbox_id": instance["sandbox_id"],
            **SandboxEventSerializer(instance["event"]).data,
        }
