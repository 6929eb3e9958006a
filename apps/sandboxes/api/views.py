from __future__ import annotations

import time
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import ApiError, ValidationFailed
from apps.sandboxes import selectors
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES
from apps.sandboxes.api.serializers import (
    ApplyPatchSerializer,
    ExecSerializer,
    OperationSerializer,
    SandboxCreateSerializer,
    SandboxEventSerializer,
    SandboxPatchSerializer,
    SandboxSerializer,
)
from apps.sandboxes.models import Operation, OperationStatus, Sandbox, State
from apps.sandboxes.services.egress import MAX_DNS_LOG, sandbox_dns_log, sandbox_set_egress
from apps.sandboxes.services.lifecycle import (
    sandbox_create,
    sandbox_delete,
    sandbox_heartbeat,
    sandbox_set_expiry,
)
from apps.sandboxes.services.operations import operation_cancel, operation_exec
from apps.sandboxes.services.patching import sandbox_apply_patch
from apps.sandboxes.services.streaming import operation_exec_stream, operation_recover
from apps.sandboxes.services.waiting import sandbox_wait_settled
from apps.tenancy.permissions import principal_of
from apps.tenancy.principal import Principal

# One long-lived renderer for single sandboxes (see SandboxSerializer.render).
_sandbox_renderer = SandboxSerializer()


def _render_sandbox(sandbox: Sandbox) -> dict[str, Any]:
    return _sandbox_renderer.render(sandbox)


class SandboxListCreateView(APIView):
    @extend_schema(
        responses={200: SandboxSerializer(many=True)},
        parameters=[
            OpenApiParameter("state", str, description="comma-separated states"),
            OpenApiParameter("image", str),
        ],
    )
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        qs = selectors.sandbox_list(
            tenant=principal.tenant,
            state=request.query_params.get("state"),
            image=request.query_params.get("image"),
        )
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(SandboxSerializer(page, many=True).data)

    @extend_schema(
        request=SandboxCreateSerializer,
        responses={201: SandboxSerializer, 200: SandboxSerializer, **ERROR_RESPONSES},
        parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)],
        description="Creates a sandbox (state `requested`; provisioning runs in a worker). "
        "The same Idempotency-Key returns the same sandbox (200); a different body with "
        "that key is a 409.",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        serializer = SandboxCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key") or serializer.validated_data.get(
            "idempotency_key"
        )
        sandbox, created = sandbox_create(
            tenant=principal.tenant,
            request=serializer.to_request(),
            idempotency_key=key,
            actor=principal.actor,
        )
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(_render_sandbox(sandbox), status=code)


class SandboxDetailView(APIView):
    @extend_schema(responses={200: SandboxSerializer, **ERROR_RESPONSES})
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        return Response(_render_sandbox(sandbox))

    @extend_schema(responses={202: SandboxSerializer, **ERROR_RESPONSES})
    def delete(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        sandbox = sandbox_delete(sandbox=sandbox, actor=principal.actor)
        return Response(_render_sandbox(sandbox), status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        request=SandboxPatchSerializer,
        responses={200: SandboxSerializer, **ERROR_RESPONSES},
        description="Changes a ready sandbox's `egress` policy (docs/egress.md): new "
        "connections follow it at once; recorded in the ledger as `egress_changed`.",
    )
    def patch(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        if not isinstance(request.data, dict):
            raise ValidationFailed("a JSON object is expected")
        unknown = sorted(set(request.data) - {"egress"})
        if unknown:
            raise ValidationFailed(
                f"only egress can be changed, not {', '.join(map(str, unknown))}",
                field=str(unknown[0]),
                code="not_patchable",
            )
        if "egress" not in request.data:
            raise ValidationFailed("egress is required", field="egress")
        sandbox = sandbox_set_egress(
            sandbox=sandbox, egress=request.data["egress"], actor=principal.actor
        )
        return Response(_render_sandbox(sandbox))


class SandboxWaitView(APIView):
    @extend_schema(
        responses={200: SandboxSerializer, **ERROR_RESPONSES},
        parameters=[OpenApiParameter("timeout", float, description="seconds, ≤ 300")],
        description="Blocks until the sandbox is ready (200), ends without becoming ready "
        "(409 `sandbox_failed`…), or the timeout passes (408 `wait_timeout`). Event-driven.",
    )
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        try:
            timeout = min(max(float(request.query_params.get("timeout", 60)), 0.0), 300.0)
        except ValueError:
            raise ApiError("timeout must be a number", field="timeout") from None
        sandbox = sandbox_wait_settled(sandbox=sandbox, timeout_s=timeout)
        if sandbox.state == State.READY:
            return Response(_render_sandbox(sandbox))
        if sandbox.state in (State.QUEUED, State.REQUESTED, State.PROVISIONING):
            raise ApiError(
                f"sandbox not ready after {timeout:g}s (still {sandbox.state})",
                code="wait_timeout",
                status_code=408,
                extra={"state": sandbox.state},
            )
        raise ApiError(
            f"sandbox is {sandbox.state}: {sandbox.status_message}".rstrip(": "),
            code=f"sandbox_{sandbox.state}",
            status_code=409,
            extra={"state": sandbox.state},
        )

    post = get


class SandboxHeartbeatView(APIView):
    @extend_schema(request=None, responses={200: SandboxSerializer, **ERROR_RESPONSES})
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        sandbox = sandbox_heartbeat(sandbox=sandbox)
        return Response(_render_sandbox(sandbox))


class SandboxTimeoutView(APIView):
    @extend_schema(
        request=inline_serializer("SandboxTimeout", {"timeout": serializers.IntegerField()}),
        responses={200: SandboxSerializer, **ERROR_RESPONSES},
        description="Sets the sandbox's remaining lifetime: it ends `timeout` seconds from now "
        "(longer or shorter than before; at most the server's maximum TTL). A sandbox "
        "that is terminating or ended is a 409.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        seconds = request.data.get("timeout") if isinstance(request.data, dict) else None
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise ApiError(
                "timeout must be a whole number of seconds",
                field="timeout",
                code="validation_error",
            )
        sandbox = sandbox_set_expiry(sandbox=sandbox, seconds=seconds)
        return Response(_render_sandbox(sandbox))


class SandboxEventsView(APIView):
    @extend_schema(responses={200: SandboxEventSerializer(many=True)})
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        events = selectors.sandbox_events(sandbox=sandbox)
        return Response({"results": SandboxEventSerializer(events, many=True).data})


class SandboxDnsLogView(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("limit", int, description="the last N queries (≤ 1000)")],
        description="The sandbox's DNS queries as the instance's resolver answered them "
        "(docs/egress.md): ts, generation, name, type, allowed, rcode, answer, flags "
        "(`rate_limited`, `tunnel_suspect`, `upstream_failed`).",
    )
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        raw = request.query_params.get("limit", str(MAX_DNS_LOG))
        if not raw.isdigit() or int(raw) < 1:
            raise ValidationFailed("limit must be a positive integer", field="limit")
        entries = sandbox_dns_log(sandbox=sandbox, limit=int(raw))
        return Response({"sandbox": sandbox.external_id, "results": entries})


class ExecView(APIView):
    @extend_schema(
        request=ExecSerializer,
        responses={200: OperationSerializer, 202: OperationSerializer, **ERROR_RESPONSES},
        description="Runs a command and returns its operation record with a typed end "
        "(`termination`: exited/signaled/timeout/output_limit/agent_error). Send an "
        "`operation_id` to make retries safe: a replay returns the stored result. With "
        "`stream: true` it answers 202 at once with the running record and `stream_url`, "
        "the websocket that streams its output (docs/realtime.md).",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        # Look up first: another tenant's sandbox is a 404 whatever the body says.
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        serializer = ExecSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data: dict[str, Any] = serializer.validated_data
        if data.get("stream"):
            return _exec_streamed(request, principal, sandbox, serializer)
        operation = operation_exec(
            principal=principal,
            sandbox=sandbox,
            request=serializer.to_request(),
            operation_id=data.get("operation_id"),
            expected_generation=data.get("generation"),
        )
        return Response(_render_operation(operation))


# The exec hot path renders with one long-lived serializer: a ModelSerializer builds
# its fields from the model on every instantiation (~1.5 ms of a ~10 ms request),
# while ``to_representation`` keeps no per-call state, so sharing it is safe.
_operation_renderer = OperationSerializer()


def _render_operation(operation: Operation) -> dict[str, Any]:
    return dict(_operation_renderer.to_representation(operation))


def _exec_streamed(
    request: Request, principal: Principal, sandbox: Sandbox, serializer: ExecSerializer
) -> Response:
    """202 with the running record and the websocket path; 200 for a finished replay."""
    data: dict[str, Any] = serializer.validated_data
    operation, _started = operation_exec_stream(
        principal=principal,
        sandbox=sandbox,
        request=serializer.to_request(),
        operation_id=data.get("operation_id"),
        expected_generation=data.get("generation"),
    )
    body = _render_operation(operation)
    body["stream_url"] = (
        f"/ws/v1/sandboxes/{sandbox.external_id}/operations/{operation.operation_id}/stream"
    )
    running = operation.status == OperationStatus.RUNNING
    return Response(body, status=status.HTTP_202_ACCEPTED if running else status.HTTP_200_OK)


class OperationListView(APIView):
    @extend_schema(responses={200: OperationSerializer(many=True)})
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        qs = selectors.operation_list(tenant=principal.tenant, sandbox=sandbox).select_related(
            "sandbox"
        )
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(OperationSerializer(page, many=True).data)


class OperationDetailView(APIView):
    @extend_schema(responses={200: OperationSerializer, **ERROR_RESPONSES})
    def get(self, request: Request, sandbox_id: str, operation_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        operation = selectors.operation_get(
            tenant=principal.tenant, sandbox=sandbox, operation_id=operation_id
        )
        if operation.status == OperationStatus.RUNNING:
            # A relay that died must not leave the record running forever.
            operation = operation_recover(operation=operation)
        return Response(OperationSerializer(operation).data)


class OperationCancelView(APIView):
    @extend_schema(
        request=None,
        responses={200: OperationSerializer, 202: OperationSerializer, **ERROR_RESPONSES},
        description="Kills a running command (SIGTERM to its session, SIGKILL after its "
        "kill grace) and answers its record: 200 once it is recorded as ended, 202 if "
        "the record still says running when the wait (kill grace + 5 s) ends. An "
        "operation that had already ended is answered unchanged (200): cancelling is "
        "idempotent.",
    )
    def post(self, request: Request, sandbox_id: str, operation_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        operation = selectors.operation_get(
            tenant=principal.tenant, sandbox=sandbox, operation_id=operation_id
        )
        if operation_cancel(operation=operation):
            # The agent has killed it; its relay records the end a moment later.
            grace = float((operation.request or {}).get("kill_grace") or 2.0)
            deadline = time.monotonic() + grace + 5.0
            operation.refresh_from_db()
            while operation.status == OperationStatus.RUNNING and time.monotonic() < deadline:
                time.sleep(0.05)
                operation.refresh_from_db()
        running = operation.status == OperationStatus.RUNNING
        return Response(
            OperationSerializer(operation).data,
            status=status.HTTP_202_ACCEPTED if running else status.HTTP_200_OK,
        )


class ApplyPatchView(APIView):
    @extend_schema(
        request=ApplyPatchSerializer,
        responses={200: OperationSerializer, **ERROR_RESPONSES},
        description="Applies a unified diff in `cwd` (default /workspace) with git apply, or "
        "patch(1), as a recorded operation. `applied` says whether it applied; a patch that "
        "does not apply is a completed operation with a non-zero exit and the tool's output.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        serializer = ApplyPatchSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data: dict[str, Any] = serializer.validated_data
        operation = sandbox_apply_patch(
            principal=principal,
            sandbox=sandbox,
            patch=data["patch"],
            cwd=data.get("cwd"),
            timeout=data.get("timeout"),
            operation_id=data.get("operation_id"),
        )
        body = dict(OperationSerializer(operation).data)
        body["applied"] = operation.termination == "exited" and operation.exit_code == 0
        return Response(body)
