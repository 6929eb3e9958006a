"""Snapshots over REST (docs/snapshots.md): capture, list, get, delete, fork."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.keyset import api_keyset_page
from apps.sandboxes import selectors
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES
from apps.sandboxes.api.serializers import (
    SandboxSerializer,
    SnapshotCreateSerializer,
    SnapshotForkSerializer,
    SnapshotSerializer,
)
from apps.sandboxes.services.snapshots import (
    sandbox_pause,
    sandbox_resume,
    snapshot_create,
    snapshot_delete,
    snapshot_fork,
)
from apps.tenancy.permissions import principal_of

CURSOR_PARAM = OpenApiParameter(
    "cursor",
    str,
    description="keyset paging: empty for the first page, then next_cursor "
    "(results + next_cursor, no count); without it, limit/offset pages",
)


def _cursor_page(request: Request, qs: Any) -> Response:
    rows, next_cursor = api_keyset_page(
        qs, cursor=request.query_params.get("cursor", ""), limit=request.query_params.get("limit")
    )
    return Response(
        {"results": SnapshotSerializer(rows, many=True).data, "next_cursor": next_cursor}
    )


class SandboxSnapshotsView(APIView):
    @extend_schema(responses={200: SnapshotSerializer(many=True)}, parameters=[CURSOR_PARAM])
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        qs = selectors.snapshot_list(tenant=principal.tenant, sandbox=sandbox)
        if "cursor" in request.query_params:
            return _cursor_page(request, qs)
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(SnapshotSerializer(page, many=True).data)

    @extend_schema(
        request=SnapshotCreateSerializer,
        responses={202: SnapshotSerializer, **ERROR_RESPONSES},
        description="Captures the ready sandbox's filesystem state (202, `capturing`; a "
        "worker captures it). GET the snapshot until `ready` (fingerprint, sizes) or "
        "`failed` (`error`): a capture that failed keeps nothing.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        serializer = SnapshotCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data: dict[str, Any] = serializer.validated_data
        snapshot = snapshot_create(
            tenant=principal.tenant,
            sandbox=sandbox,
            actor=principal.actor,
            name=data.get("name", ""),
            manifest=data.get("manifest"),
            probes=data.get("probes"),
            ttl_seconds=data.get("ttl_seconds"),
            volatile=data.get("volatile"),
        )
        return Response(SnapshotSerializer(snapshot).data, status=status.HTTP_202_ACCEPTED)


class SnapshotListView(APIView):
    @extend_schema(responses={200: SnapshotSerializer(many=True)}, parameters=[CURSOR_PARAM])
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        qs = selectors.snapshot_list(tenant=principal.tenant)
        if "cursor" in request.query_params:
            return _cursor_page(request, qs)
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(SnapshotSerializer(page, many=True).data)


class SnapshotDetailView(APIView):
    @extend_schema(responses={200: SnapshotSerializer, **ERROR_RESPONSES})
    def get(self, request: Request, snapshot_id: str) -> Response:
        principal = principal_of(request)
        snapshot = selectors.snapshot_get(tenant=principal.tenant, snapshot_id=snapshot_id)
        return Response(SnapshotSerializer(snapshot).data)

    @extend_schema(responses={200: SnapshotSerializer, **ERROR_RESPONSES})
    def delete(self, request: Request, snapshot_id: str) -> Response:
        principal = principal_of(request)
        snapshot = selectors.snapshot_get(tenant=principal.tenant, snapshot_id=snapshot_id)
        snapshot = snapshot_delete(snapshot=snapshot)
        return Response(SnapshotSerializer(snapshot).data)


class SnapshotForkView(APIView):
    @extend_schema(
        request=SnapshotForkSerializer,
        responses={201: SandboxSerializer(many=True), 200: SandboxSerializer(many=True)},
        parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)],
        description="K new sandboxes restored from the snapshot, shaped like the sandbox it "
        "was taken of; each is `ready` only once its state matched the snapshot's "
        "fingerprint (else `failed`, reason `state_divergence`, with `divergence`). All K "
        "or none (a quota that admits fewer refuses the fork). The same Idempotency-Key "
        "returns the same K (200).",
    )
    def post(self, request: Request, snapshot_id: str) -> Response:
        principal = principal_of(request)
        snapshot = selectors.snapshot_get(tenant=principal.tenant, snapshot_id=snapshot_id)
        serializer = SnapshotForkSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data: dict[str, Any] = serializer.validated_data
        key = request.headers.get("Idempotency-Key") or data.get("idempotency_key")
        children, created = snapshot_fork(
            tenant=principal.tenant,
            snapshot=snapshot,
            count=data["count"],
            idempotency_key=key,
            actor=principal.actor,
        )
        renderer = SandboxSerializer()
        body = {"sandboxes": [renderer.render(c) for c in children]}
        return Response(body, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class SandboxPauseView(APIView):
    @extend_schema(
        request=None,
        responses={202: SandboxSerializer, **ERROR_RESPONSES},
        description="`ready` → `paused`: no new operation starts; a worker captures the "
        "sandbox's filesystem state and releases its compute. If the capture fails it is "
        "`ready` again (ledger reason `pause_failed`). Process memory is not kept.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        sandbox = sandbox_pause(sandbox=sandbox, actor=principal.actor)
        return Response(SandboxSerializer().render(sandbox), status=status.HTTP_202_ACCEPTED)


class SandboxResumeView(APIView):
    @extend_schema(
        request=None,
        responses={202: SandboxSerializer, **ERROR_RESPONSES},
        description="`paused` → `requested`: restored under the same id with generation + "
        "1, `ready` once its state matched the pause's fingerprint (`/wait`). Operations "
        "naming the old generation get 409 `stale_generation`.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        sandbox = sandbox_resume(sandbox=sandbox, actor=principal.actor)
        return Response(SandboxSerializer().render(sandbox), status=status.HTTP_202_ACCEPTED)
