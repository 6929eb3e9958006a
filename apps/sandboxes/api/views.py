from __future__ import annotations

import base64
import binascii
import math
import time
from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import ApiError, ValidationFailed
from apps.core.keyset import newest_first
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
from apps.sandboxes.services.labels import labels_patch_check, sandbox_patch_labels
from apps.sandboxes.services.lifecycle import (
    sandbox_create,
    sandbox_delete,
    sandbox_heartbeat,
    sandbox_set_expiry,
)
from apps.sandboxes.services.operations import (
    operation_cancel,
    operation_exec,
    operation_send_stdin,
)
from apps.sandboxes.services.patching import sandbox_apply_patch
from apps.sandboxes.services.sandbox_metrics import sandbox_metrics
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
            OpenApiParameter(
                "label",
                str,
                many=True,
                description="repeatable: key=value (that label has that value) or key (the "
                "label is present); all must match",
            ),
            OpenApiParameter("limit", int, description="page size, 1-1000 (default 50)"),
            OpenApiParameter("cursor", str, description="next_cursor of the previous page"),
            OpenApiParameter("offset", int, description="legacy offset paging (no cursor)"),
        ],
        description="The team's sandboxes, newest first, one page at a time: `results`, "
        "`count` (all that match, on the first page only: null on a cursor page, so paging "
        "through N sandboxes counts them once, not once per page), `next_cursor` (null on "
        "the last page) and `next` (its URL). Cursor pages are keyset pages on "
        "(created_at, id): stable while sandboxes come and go. `offset` selects the older "
        "limit/offset paging.",
    )
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        params = request.query_params
        qs = selectors.sandbox_list(
            tenant=principal.tenant,
            state=params.get("state"),
            image=params.get("image"),
            labels=params.getlist("label"),
        )
        if "offset" in params and "cursor" not in params:
            paginator = LimitOffsetPagination()
            page = paginator.paginate_queryset(qs, request, view=self)
            return paginator.get_paginated_response(SandboxSerializer(page, many=True).data)
        limit = selectors.page_limit(params.get("limit"), default=50)
        rows, next_cursor = selectors.sandbox_keyset_page(
            qs, cursor=params.get("cursor"), limit=limit
        )
        # Counted on the first page only: a COUNT reads every matching row, and a
        # caller paging through them all would pay it once per page. A first page that
        # is also the last is its own count.
        count: int | None = None
        if not params.get("cursor"):
            count = len(rows) if next_cursor is None else qs.count()
        next_url = None
        if next_cursor is not None:
            query = params.copy()
            query["cursor"] = next_cursor
            query.pop("offset", None)
            next_url = request.build_absolute_uri(f"{request.path}?{query.urlencode()}")
        return Response(
            {
                "count": count,
                "next": next_url,
                "previous": None,
                "next_cursor": next_cursor,
                "results": SandboxSerializer(rows, many=True).data,
            }
        )

    @extend_schema(
        request=SandboxCreateSerializer,
        responses={201: SandboxSerializer, 200: SandboxSerializer, **ERROR_RESPONSES},
        parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)],
        description="Creates a sandbox (state `requested`; provisioning runs in a worker). "
        "The same Idempotency-Key returns the same sandbox (200); a different body with "
        "that key is a 409. A create that asked to wait over a limit answers state "
        "`queued` with its `queue_position` and `Retry-After` (when to look again).",
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
        headers = queued_retry_after() if sandbox.state == State.QUEUED else None
        return Response(_render_sandbox(sandbox), status=code, headers=headers)


def queued_retry_after() -> dict[str, str]:
    """When a client should look at a queued sandbox again: the admission sweep's period
    (a drain also runs on every sandbox end, so it may start sooner)."""
    return {"Retry-After": str(max(1, math.ceil(settings.HEDGEROW_ADMISSION_SWEEP_S)))}


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
        description="Changes a sandbox's `labels` and/or a ready sandbox's `egress` policy. "
        "`labels` is a merge patch: a key with a string value is set, a key with null is "
        "removed, other keys are kept (create's label rules apply to the result; ledger "
        "event `labels_changed`; a deleted, failed or lost sandbox is a 409). `egress` "
        "(docs/egress.md): new connections follow it at once; ledger event "
        "`egress_changed`. Both are checked before either is applied.",
    )
    def patch(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        if not isinstance(request.data, dict):
            raise ValidationFailed("a JSON object is expected")
        unknown = sorted(set(request.data) - {"egress", "labels"})
        if unknown:
            raise ValidationFailed(
                f"only egress and labels can be changed, not {', '.join(map(str, unknown))}",
                field=str(unknown[0]),
                code="not_patchable",
            )
        if not request.data:
            raise ValidationFailed("egress or labels is required", field="labels")
        if "labels" in request.data:
            # Checked whole before anything changes: a bad label patch leaves the
            # egress as it was too.
            labels_patch_check(sandbox=sandbox, patch=request.data["labels"])
        if "egress" in request.data:
            sandbox = sandbox_set_egress(
                sandbox=sandbox, egress=request.data["egress"], actor=principal.actor
            )
        if "labels" in request.data:
            sandbox = sandbox_patch_labels(
                sandbox=sandbox, patch=request.data["labels"], actor=principal.actor
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
                headers=queued_retry_after() if sandbox.state == State.QUEUED else None,
            )
        raise ApiError(
            f"sandbox is {sandbox.state}: {sandbox.status_message}".rstrip(": "),
            code=f"sandbox_{sandbox.state}",
            status_code=409,
            extra={"state": sandbox.state},
        )

    @extend_schema(
        request=None,
        responses={200: SandboxSerializer, **ERROR_RESPONSES},
        parameters=[OpenApiParameter("timeout", float, description="seconds, ≤ 300")],
        description="The same wait as GET, for clients that can only POST (no body).",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        return self.get(request, sandbox_id)


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
        responses={200: dict, **ERROR_RESPONSES},
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


class SandboxMetricsView(APIView):
    @extend_schema(
        responses={
            200: inline_serializer(
                "SandboxMetrics",
                {
                    "sandbox": serializers.CharField(),
                    "ts": serializers.FloatField(),
                    "memory_bytes": serializers.IntegerField(),
                    "cpu_usage_ns": serializers.IntegerField(),
                    "pids": serializers.IntegerField(),
                    "disk_bytes": serializers.IntegerField(allow_null=True),
                    "cpu_source": serializers.CharField(),
                    "memory_limit_bytes": serializers.IntegerField(),
                    "cpu_millis": serializers.IntegerField(),
                    "history": serializers.ListField(child=serializers.DictField(), required=False),
                },
            ),
            **ERROR_RESPONSES,
        },
        description="The ready sandbox's counters now, from its cgroups (docs/frontend.md "
        '"Metrics"): memory bytes, cumulative CPU ns (a rate needs two samples), pids, '
        "disk bytes of its quota (null without one). Each read is also kept on the server "
        "(a bounded per-sandbox history, dropped with the sandbox): `?since=<unix s>` adds "
        "`history`, the kept samples after it, oldest first. 409 `metrics_unavailable` on "
        "a backend without counters (kubernetes).",
        parameters=[
            OpenApiParameter(
                "since", float, description="unix seconds: also return the kept samples after it"
            )
        ],
    )
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        return Response(sandbox_metrics(sandbox=sandbox, since=request.query_params.get("since")))


class ExecView(APIView):
    """``POST /api/v1/sandboxes/<id>/exec`` for what the fast path hands on.

    Most REST execs never reach this view: ``api/exec_fastpath.py`` (ASGI middleware in
    front of Django) answers the plain case on the event loop through
    ``services/exec_async.py`` and gives everything else, body replayed, to this view
    (session auth, ``stream: true``, a body its strict check doubts, a replay, a refused
    admission, Redis or Postgres trouble). Both answer byte for byte alike
    (``tests/test_exec_fastpath.py``); docs/architecture.md, "An exec, end to end".
    """

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
    @extend_schema(
        responses={200: OperationSerializer(many=True)},
        parameters=[
            OpenApiParameter("limit", int, description="page size, 1-1000 (default 50)"),
            OpenApiParameter("cursor", str, description="next_cursor of the previous page"),
            OpenApiParameter("offset", int, description="legacy offset paging (no cursor)"),
        ],
        description="The sandbox's operations, newest first, one keyset page at a time: "
        "`results`, `count` (first page only), `next_cursor` (null on the last page) and "
        "`next`. A sandbox's operations grow with every exec: an offset page reads every "
        "row before it, a cursor page only its own. `offset` selects the older paging.",
    )
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        qs = selectors.operation_list(tenant=principal.tenant, sandbox=sandbox).select_related(
            "sandbox"
        )
        params = request.query_params
        if "offset" in params and "cursor" not in params:
            paginator = LimitOffsetPagination()
            page = paginator.paginate_queryset(qs, request, view=self)
            return paginator.get_paginated_response(OperationSerializer(page, many=True).data)
        limit = selectors.page_limit(params.get("limit"), default=50)
        keyset = newest_first(qs, cursor=params.get("cursor") or "", limit=limit)
        count: int | None = None
        if not params.get("cursor"):
            count = len(keyset.rows) if not keyset.next_cursor else qs.count()
        next_url = None
        if keyset.next_cursor:
            query = params.copy()
            query["cursor"] = keyset.next_cursor
            next_url = request.build_absolute_uri(f"{request.path}?{query.urlencode()}")
        return Response(
            {
                "count": count,
                "next": next_url,
                "previous": None,
                "next_cursor": keyset.next_cursor or None,
                "results": OperationSerializer(keyset.rows, many=True).data,
            }
        )


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


class OperationStdinView(APIView):
    @extend_schema(
        request=inline_serializer(
            "OperationStdin",
            {
                "data": serializers.CharField(required=False, help_text="base64 bytes"),
                "text": serializers.CharField(required=False, help_text="UTF-8 text"),
                "eof": serializers.BooleanField(required=False, default=False),
                "offset": serializers.IntegerField(
                    required=False, help_text="where data starts in the whole input"
                ),
            },
        ),
        responses={200: None, **ERROR_RESPONSES},
        description="Input for a running command started with `stdin_open: true`, in "
        "order: `data` (base64) or `text`, at most 1 MiB a call; `eof: true` closes its "
        "stdin after it; `offset` (optional) is where the data starts in the command's "
        "whole input: a resend of accepted bytes is not written twice (safe retries), "
        "another mismatch is 409 `stdin_offset`. Answers `{operation_id, accepted, "
        "buffered, offset, eof}` (`offset`: where the input stands now). 409 "
        "`stdin_closed` when the command takes no input (not started with `stdin_open`, "
        "EOF sent, it closed its stdin, or it ended); 429 `stdin_full` with `Retry-After` "
        "when it has not read 1 MiB it was sent. Another team's operation is a 404.",
    )
    def post(self, request: Request, sandbox_id: str, operation_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        operation = selectors.operation_get(
            tenant=principal.tenant, sandbox=sandbox, operation_id=operation_id
        )
        body = request.data
        if not isinstance(body, dict):
            raise ValidationFailed("a JSON object is expected")
        unknown = sorted(set(body) - {"data", "text", "eof", "offset"})
        if unknown:
            raise ValidationFailed(f"unknown field {unknown[0]!r}", field=str(unknown[0]))
        if "data" in body and "text" in body:
            raise ValidationFailed("give data or text, not both", field="text")
        eof = body.get("eof", False)
        if not isinstance(eof, bool):
            raise ValidationFailed("eof must be true or false", field="eof")
        data = b""
        if "text" in body:
            if not isinstance(body["text"], str):
                raise ValidationFailed("text must be a string", field="text")
            data = body["text"].encode()
        elif "data" in body:
            try:
                data = base64.b64decode(str(body["data"]), validate=True)
            except (binascii.Error, ValueError):
                raise ValidationFailed("data must be base64", field="data") from None
        if not data and not eof:
            raise ValidationFailed("nothing to send: give data, text or eof", field="data")
        offset = body.get("offset")
        if offset is not None and (
            isinstance(offset, bool) or not isinstance(offset, int) or offset < 0
        ):
            raise ValidationFailed("offset must be a non-negative integer", field="offset")
        answer = operation_send_stdin(operation=operation, data=data, eof=eof, offset=offset)
        return Response(answer)


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
