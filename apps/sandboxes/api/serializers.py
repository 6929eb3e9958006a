from __future__ import annotations

import base64
import binascii
from decimal import Decimal
from typing import Any

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.billing.storage import storage_cost_for_snapshots
from apps.core import jsonsafe
from apps.core.errors import ValidationFailed
from apps.sandboxes.metering.usage import sandbox_billing
from apps.sandboxes.models import Operation, Sandbox, SandboxEvent, Snapshot, State
from apps.sandboxes.quantities import QuantityError, parse_cpu_millis, parse_memory_mib
from apps.sandboxes.services.lifecycle import (
    SandboxRequest,
    egress_policy,
    validate_external_id,
    validate_labels,
)
from apps.sandboxes.services.operations import ExecRequest


def _field_error(exc: ValidationFailed) -> serializers.ValidationError:
    return serializers.ValidationError(exc.message, code=exc.code)


@extend_schema_field({"oneOf": [{"type": "number"}, {"type": "string"}]})
class QuantityField(serializers.Field):  # type: ignore[type-arg]
    """Accepts numbers or Kubernetes quantity strings."""

    def __init__(self, parser: Any, **kwargs: Any) -> None:
        self.parser = parser
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:
        try:
            return int(self.parser(data))
        except QuantityError as exc:
            raise serializers.ValidationError(str(exc), code="invalid_quantity") from exc

    def to_representation(self, value: Any) -> Any:
        return value


# Integer columns are Postgres int4: a bigger number is a 400, not a DataError.
INT4_MAX = 2**31 - 1


class StringField(serializers.CharField):
    """A CharField that takes only a JSON string: DRF would turn 5 into "5", which is
    now a Docker Hub reference (docker.io/library/5) — a number is a client's mistake,
    answered 400, not a registry lookup."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class SandboxCreateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    image = StringField(
        max_length=200,
        default="host",
        help_text="`host`, an imported image, or an OCI reference (python:3.12-slim, "
        "ghcr.io/org/img@sha256:…) pulled with your stored registry credentials",
    )
    cpu = QuantityField(parse_cpu_millis, required=False, help_text="cores: 1, 0.5, '500m'")
    memory = QuantityField(parse_memory_mib, required=False, help_text="MiB or '512Mi', '2Gi'")
    network_access = serializers.BooleanField(
        required=False, help_text="legacy: true is egress 'all'; give egress instead"
    )
    egress = serializers.JSONField(
        required=False,
        help_text="'none' (default), 'all', or {\"allow\": [\"pkg.example.org\", "
        '"*.git.example.com", "10.20.0.0/16:443"], "dns": "filtered"} (docs/egress.md)',
    )
    ttl_seconds = serializers.IntegerField(min_value=10, required=False)
    heartbeat_timeout_s = serializers.IntegerField(
        min_value=5, max_value=INT4_MAX, required=False, allow_null=True
    )
    labels = serializers.DictField(child=serializers.CharField(), required=False)
    sandbox_id = serializers.CharField(max_length=63, required=False)
    idempotency_key = serializers.CharField(max_length=128, required=False)
    from_snapshot = serializers.CharField(
        max_length=64,
        required=False,
        help_text="start from this snapshot's state (one of the team's, `ready`); the image "
        "is the snapshot's",
    )
    queue = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="over a quota, wait in the admission queue (state `queued`) instead of "
        "a 429; omitted: the team's default",
    )

    def validate_cpu(self, value: int) -> int:
        if value > settings.HEDGEROW_MAX_CPU_MILLIS:
            raise serializers.ValidationError(
                f"at most {settings.HEDGEROW_MAX_CPU_MILLIS}m cpu", code="too_large"
            )
        return value

    def validate_memory(self, value: int) -> int:
        if value < 32:
            raise serializers.ValidationError("at least 32Mi memory", code="too_small")
        if value > settings.HEDGEROW_MAX_MEMORY_MIB:
            raise serializers.ValidationError(
                f"at most {settings.HEDGEROW_MAX_MEMORY_MIB}Mi memory", code="too_large"
            )
        return value

    def validate_ttl_seconds(self, value: int) -> int:
        if value > settings.HEDGEROW_MAX_TTL_S:
            raise serializers.ValidationError(
                f"at most {settings.HEDGEROW_MAX_TTL_S}s", code="too_large"
            )
        return value

    def validate_sandbox_id(self, value: str) -> str:
        try:
            return validate_external_id(value)
        except ValidationFailed as exc:
            raise _field_error(exc) from exc

    def validate_labels(self, value: dict[str, Any]) -> dict[str, str]:
        try:
            return validate_labels(value)
        except ValidationFailed as exc:
            raise _field_error(exc) from exc

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            attrs["egress_policy"] = egress_policy(attrs.get("egress"), attrs.get("network_access"))
        except ValidationFailed as exc:
            raise serializers.ValidationError(
                {"egress": [serializers.ErrorDetail(exc.message, code=exc.extra["reason"])]}
            ) from exc
        return attrs

    def to_request(self) -> SandboxRequest:
        data = self.validated_data
        from_snapshot = data.get("from_snapshot")
        policy = data["egress_policy"]
        return SandboxRequest(
            # a restore takes the snapshot's image unless one is named (it must match)
            image="" if from_snapshot and "image" not in self.initial_data else data["image"],
            cpu_millis=data.get("cpu", 1000),
            memory_mib=data.get("memory", 1024),
            network_access=policy.routed,
            egress=policy.to_json(),
            ttl_seconds=data.get("ttl_seconds") or settings.HEDGEROW_DEFAULT_TTL_S,
            heartbeat_timeout_s=data.get("heartbeat_timeout_s"),
            labels=data.get("labels") or {},
            external_id=data.get("sandbox_id"),
            queue=data.get("queue"),
            snapshot_id=from_snapshot,
        )


class SandboxPatchSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """The schema of PATCH /sandboxes/{id}: the labels and the egress policy change."""

    egress = serializers.JSONField(required=False, help_text="'none', 'all' or {\"allow\": [...]}")
    labels = serializers.DictField(
        child=serializers.CharField(allow_null=True),
        required=False,
        help_text="merge patch: key → string sets it, key → null removes it",
    )


_BILLING_ATTR = "_hedgerow_render_billing"


class SandboxSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    id = serializers.CharField(source="external_id")
    cpu = serializers.SerializerMethodField()
    memory = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField(
        help_text="1-based place in the admission queue while `queued`, else null"
    )
    cost = serializers.SerializerMethodField(
        help_text="cost so far (running sandboxes accrue), USD as a decimal string; null "
        "if it never held resources"
    )
    image_digest = serializers.CharField(
        read_only=True, help_text="the image's resolved manifest digest ('' for host)"
    )
    progress = serializers.SerializerMethodField(
        help_text="image pull progress {phase, layers, bytes, total} while provisioning, else null"
    )
    from_snapshot = serializers.SerializerMethodField(
        help_text="the snapshot it was restored from, else null"
    )
    divergence = serializers.JSONField(
        read_only=True,
        help_text="a restore that was not the snapshot's state (`failed`, reason "
        "`state_divergence`): [{path, expected, actual}] or [{probe, expected, actual}]",
    )

    class Meta:
        model = Sandbox
        fields = [
            "id",
            "state",
            "generation",
            "image",
            "image_digest",
            "progress",
            "cpu",
            "cpu_millis",
            "memory",
            "memory_mib",
            "network_access",
            "egress",
            "isolation",
            "backend",
            "node",
            "labels",
            "ttl_seconds",
            "expires_at",
            "heartbeat_timeout_s",
            "last_heartbeat_at",
            "status_message",
            "created_at",
            "ready_at",
            "terminated_at",
            "queue_position",
            "cost",
            "from_snapshot",
            "divergence",
        ]

    def render(self, obj: Sandbox) -> dict[str, Any]:
        """``SandboxSerializer(obj).data`` from one long-lived instance: a ModelSerializer
        builds its fields from the model on every instantiation (~1–2 ms of CPU, paid by
        every create, wait and delete), while rendering keeps no per-call state on the
        serializer — the billing fields travel on the object itself."""
        setattr(obj, _BILLING_ATTR, sandbox_billing(sandboxes=[obj])[obj.pk])
        try:
            return dict(self.to_representation(obj))
        finally:
            delattr(obj, _BILLING_ATTR)

    def _billing(self, obj: Sandbox) -> Any:
        # Billing fields for the whole page at once (quotas/metering live in billing).
        given = getattr(obj, _BILLING_ATTR, None)
        if given is not None:
            return given
        root = self.root
        cache: dict[Any, Any] | None = getattr(root, "_billing_cache", None)
        if cache is None or obj.pk not in cache:
            page = root.instance if isinstance(root.instance, list) else [obj]
            cache = sandbox_billing(sandboxes=page if obj in page else [obj])
            root._billing_cache = cache  # type: ignore[attr-defined]
        return cache[obj.pk]

    def get_queue_position(self, obj: Sandbox) -> int | None:
        position: int | None = self._billing(obj).queue_position
        return position

    def get_cost(self, obj: Sandbox) -> str | None:
        cost = self._billing(obj).cost
        return None if cost is None else str(cost.quantize(Decimal("0.000001")))

    def get_from_snapshot(self, obj: Sandbox) -> str | None:
        return str(obj.snapshot_id) if obj.snapshot_id else None

    def get_progress(self, obj: Sandbox) -> dict[str, Any] | None:
        return obj.progress if obj.state == State.PROVISIONING and obj.progress else None

    def get_cpu(self, obj: Sandbox) -> str:
        return f"{obj.cpu_millis}m"

    def get_memory(self, obj: Sandbox) -> str:
        return f"{obj.memory_mib}Mi"


class SandboxEventSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = SandboxEvent
        fields = [
            "at",
            "event",
            "from_state",
            "to_state",
            "reason",
            "message",
            "actor",
            "generation",
        ]


class ExecSerializer(serializers.Serializer):  # type: ignore[type-arg]
    command = serializers.JSONField(help_text="a shell string, or a list of argv strings")
    cwd = serializers.CharField(required=False, allow_null=True)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True), required=False)
    timeout = serializers.FloatField(
        min_value=0.01, max_value=86400, required=False, allow_null=True
    )
    stdin = serializers.CharField(required=False, allow_null=True, help_text="base64 bytes")
    stdin_open = serializers.BooleanField(
        default=False,
        help_text="keep the command's stdin open for POST …/operations/{id}/stdin (after "
        "`stdin`, if given) until EOF is sent",
    )
    login_shell = serializers.BooleanField(default=False)
    output_window = serializers.IntegerField(
        min_value=256, max_value=64 * 1024 * 1024, required=False
    )
    output_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    operation_id = serializers.RegexField(r"^[A-Za-z0-9._:-]{1,128}$", required=False)
    generation = serializers.IntegerField(min_value=0, max_value=INT4_MAX, required=False)
    stream = serializers.BooleanField(default=False)

    def validate_command(self, value: Any) -> str | list[str]:
        jsonsafe.require_no_nul(value, "command")  # execve cannot take it: 400 naming argv[i]
        if isinstance(value, str):
            if not value.strip():
                raise serializers.ValidationError("command is empty", code="blank")
            return value
        if isinstance(value, list) and value and all(isinstance(a, str) for a in value):
            return value
        raise serializers.ValidationError(
            "command must be a non-empty string or a non-empty list of strings", code="invalid"
        )

    def validate_cwd(self, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise serializers.ValidationError(
                "cwd must be an absolute path", code="path_not_absolute"
            )
        return value

    def validate_env(self, value: dict[str, str]) -> dict[str, str]:
        jsonsafe.require_no_nul(value, "env")  # values are CharFields; this covers the keys
        return value

    def validate_stdin(self, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise serializers.ValidationError("stdin must be base64", code="invalid") from exc
        return value

    def to_request(self) -> ExecRequest:
        data = self.validated_data
        return ExecRequest(
            command=data["command"],
            cwd=data.get("cwd"),
            env=data.get("env") or {},
            timeout=data.get("timeout"),
            stdin_b64=data.get("stdin"),
            login_shell=data["login_shell"],
            output_window=data.get("output_window"),
            output_limit=data.get("output_limit"),
            stdin_open=data["stdin_open"],
        )


def render_stream(meta: dict[str, Any]) -> str:
    """The text a human or a model reads: whole stream, or head + marker + tail."""
    if not meta:
        return ""
    if meta.get("pruned"):  # retention dropped it (docs/operations.md "Retention")
        size = meta.get("total_bytes")
        return f"[… output pruned by retention{f' ({size} bytes)' if size else ''} …]"
    if meta.get("encoding") == "base64":
        head = base64.b64decode(meta.get("head", "")).decode("utf-8", "replace")
        tail = base64.b64decode(meta.get("tail", "")).decode("utf-8", "replace")
    else:
        head, tail = meta.get("head", ""), meta.get("tail", "")
    if not meta.get("truncated"):
        return str(head)
    omitted = int(meta.get("total_bytes", 0)) - len(head.encode()) - len(tail.encode())
    return f"{head}\n[… {max(omitted, 0)} bytes omitted …]\n{tail}"


class OperationSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    id = serializers.CharField(source="operation_id")
    sandbox_id = serializers.CharField(source="sandbox.external_id")
    timed_out = serializers.SerializerMethodField()
    stdout = serializers.SerializerMethodField()
    stderr = serializers.SerializerMethodField()
    output = serializers.SerializerMethodField()

    class Meta:
        model = Operation
        fields = [
            "id",
            "sandbox_id",
            "generation",
            "kind",
            "status",
            "termination",
            "exit_code",
            "signal",
            "timed_out",
            "stdout",
            "stderr",
            "output",
            "usage",
            "children_remained",
            "error",
            "created_at",
            "finished_at",
        ]

    def get_timed_out(self, obj: Operation) -> bool:
        return obj.termination == "timeout"

    def get_stdout(self, obj: Operation) -> str:
        return render_stream(obj.stdout)

    def get_stderr(self, obj: Operation) -> str:
        return render_stream(obj.stderr)

    def get_output(self, obj: Operation) -> dict[str, Any]:
        return {"stdout": obj.stdout, "stderr": obj.stderr}


class ApplyPatchSerializer(serializers.Serializer):  # type: ignore[type-arg]
    patch = serializers.CharField(trim_whitespace=False, help_text="a unified diff")
    cwd = serializers.CharField(required=False, allow_null=True)
    timeout = serializers.FloatField(
        min_value=0.01, max_value=3600, required=False, allow_null=True
    )
    operation_id = serializers.RegexField(r"^[A-Za-z0-9._:-]{1,128}$", required=False)

    def validate_cwd(self, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise serializers.ValidationError(
                "cwd must be an absolute path", code="path_not_absolute"
            )
        return value


class SnapshotCreateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=128, required=False, allow_blank=True, default="")
    manifest = serializers.JSONField(
        required=False,
        help_text="yours, stored as given: message history, tool schema, model and policy "
        "version, sampling parameters, RNG seeds, services to restart",
    )
    probes = serializers.JSONField(
        required=False,
        help_text='read-only commands run at capture and in every restored child: [{"name", '
        '"command", "volatile": false, "timeout": 30}]',
    )
    ttl_seconds = serializers.IntegerField(required=False)
    volatile = serializers.JSONField(
        required=False,
        help_text="parts of the runtime fingerprint shown but never compared: "
        '"ports", "port:N", "processes", "process:NAME", "env", "env:NAME"',
    )


class SnapshotForkSerializer(serializers.Serializer):  # type: ignore[type-arg]
    count = serializers.IntegerField(help_text="K children, 1..64: all or none")
    idempotency_key = serializers.CharField(max_length=100, required=False)


class SnapshotSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    sandbox = serializers.CharField(source="sandbox.external_id", read_only=True)
    parent = serializers.SerializerMethodField()  # type: ignore[assignment]
    storage_cost = serializers.SerializerMethodField(
        help_text="USD so far for keeping its bytes (per GiB-hour, docs/billing.md); "
        "null if never captured"
    )

    class Meta:
        model = Snapshot
        fields = [
            "id",
            "name",
            "kind",
            "state",
            "sandbox",
            "parent",
            "image",
            "image_digest",
            "generation",
            "manifest",
            "probes",
            "fingerprint",
            "size_bytes",
            "capture_s",
            "capture_wall_s",
            "error",
            "ttl_seconds",
            "expires_at",
            "created_at",
            "captured_at",
            "deleted_at",
            "storage_cost",
        ]

    def get_parent(self, obj: Snapshot) -> str | None:
        return str(obj.parent_id) if obj.parent_id else None

    def get_storage_cost(self, obj: Snapshot) -> str | None:
        cost = storage_cost_for_snapshots(snapshot_ids=[obj.pk]).get(obj.pk)
        return None if cost is None else str(cost.quantize(Decimal("0.000001")))
