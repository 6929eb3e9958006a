from __future__ import annotations

from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import parsers, serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import ApiError
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES
from apps.tenancy.permissions import principal_of
from apps.trajectories import selectors
from apps.trajectories.api.serializers import (
    EpisodeCloseSerializer,
    EpisodeOpenSerializer,
    EpisodeSerializer,
    RelabelRecordSerializer,
    RelabelSerializer,
    StepAppendSerializer,
    StepSerializer,
    TimelineItemSerializer,
)
from apps.trajectories.models import Episode
from apps.trajectories.services.episodes import (
    episode_attach_sandbox,
    episode_attribute,
    episode_close,
    episode_open,
    episode_relabel,
    step_append,
)
from apps.trajectories.services.transfer import episodes_export, episodes_import

FILTER_DOCS = [
    OpenApiParameter(name, str, description="comma = any of") for name in selectors.EXACT_FILTERS
] + [
    OpenApiParameter("since", str, description="ISO time, started at or after"),
    OpenApiParameter("until", str, description="ISO time, started before"),
    OpenApiParameter("label", str, description="key=value or key"),
    OpenApiParameter("relabeled", bool),
]


def _filters(request: Request) -> dict[str, str]:
    return {
        k: request.query_params[k] for k in selectors.FILTER_PARAMS if k in request.query_params
    }


def _episode(request: Request, episode_id: str) -> Episode:
    return selectors.episode_get(tenant=principal_of(request).tenant, episode_id=episode_id)


class EpisodeListCreateView(APIView):
    @extend_schema(responses={200: EpisodeSerializer(many=True)}, parameters=FILTER_DOCS)
    def get(self, request: Request) -> Response:
        qs = selectors.episode_list(tenant=principal_of(request).tenant, filters=_filters(request))
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(
            qs.prefetch_related("sandbox_links", "relabels"), request, view=self
        )
        return paginator.get_paginated_response(EpisodeSerializer(page, many=True).data)

    @extend_schema(
        request=EpisodeOpenSerializer,
        responses={201: EpisodeSerializer, 200: EpisodeSerializer, **ERROR_RESPONSES},
        description="Opens an episode. The same `episode_id` returns the same episode (200).",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        serializer = EpisodeOpenSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        episode, created = episode_open(
            tenant=principal.tenant,
            actor=principal.actor,
            fields=serializer.episode_fields(),
            sandbox_ids=data.get("sandbox_ids") or [],
            episode_id=data.get("episode_id"),
            started_at=data.get("started_at"),
            branch=serializer.branch(),
        )
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(EpisodeSerializer(episode).data, status=code)


class EpisodeStatsView(APIView):
    @extend_schema(
        responses={200: dict},
        parameters=FILTER_DOCS,
        description="η = valid/N, cost per valid episode = cost/(N·η), success raw and "
        "conditional on valid infrastructure, per-task success (tasks, not rollouts).",
    )
    def get(self, request: Request) -> Response:
        qs = selectors.episode_list(tenant=principal_of(request).tenant, filters=_filters(request))
        return Response(selectors.episode_stats(episodes=qs).as_dict())


class EpisodeExportView(APIView):
    @extend_schema(
        responses={(200, "application/x-ndjson"): str},
        parameters=FILTER_DOCS,
        description="JSONL, one `hedgerow.episode/v1` record per line (docs/trajectories.md).",
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        qs = selectors.episode_list(tenant=principal_of(request).tenant, filters=_filters(request))
        response = StreamingHttpResponse(
            episodes_export(episodes=qs), content_type="application/x-ndjson"
        )
        response["Content-Disposition"] = 'attachment; filename="episodes.jsonl"'
        return response


class RawBodyParser(parsers.BaseParser):
    media_type = "*/*"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return stream.read() if stream is not None else b""


class EpisodeImportView(APIView):
    parser_classes = [RawBodyParser]

    @extend_schema(
        request={"application/x-ndjson": str},
        responses={200: dict, **ERROR_RESPONSES},
        parameters=[OpenApiParameter("dry_run", bool)],
        description="Imports JSONL. Every line is checked; errors come back with line "
        "numbers (`errors: [{line, field, message}]`) and valid lines are imported. "
        "Status 200 when every line was imported, 207 when some were not.",
    )
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, bytes) else b""
        dry_run = request.query_params.get("dry_run", "").lower() in ("1", "true", "yes")
        report = episodes_import(
            tenant=principal_of(request).tenant, lines=body.splitlines(), dry_run=dry_run
        )
        code = status.HTTP_200_OK if not report.errors else status.HTTP_207_MULTI_STATUS
        return Response(report.as_dict(), status=code)


class EpisodeCompareView(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("a", str, required=True), OpenApiParameter("b", str)],
        responses={200: dict, **ERROR_RESPONSES},
    )
    def get(self, request: Request) -> Response:
        a_id, b_id = request.query_params.get("a"), request.query_params.get("b")
        if not a_id or not b_id:
            raise ApiError("compare needs a and b", field="a" if not a_id else "b")
        a, b = _episode(request, a_id), _episode(request, b_id)
        pairs = selectors.episode_compare(a=a, b=b)
        return Response(
            {
                "a": EpisodeSerializer(a).data,
                "b": EpisodeSerializer(b).data,
                "steps": [
                    {
                        "index": i,
                        "a": StepSerializer(sa).data if sa else None,
                        "b": StepSerializer(sb).data if sb else None,
                    }
                    for i, (sa, sb) in enumerate(pairs)
                ],
            }
        )


class EpisodeDetailView(APIView):
    @extend_schema(responses={200: EpisodeSerializer, **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str) -> Response:
        return Response(EpisodeSerializer(_episode(request, episode_id)).data)


class StepListAppendView(APIView):
    @extend_schema(responses={200: StepSerializer(many=True)})
    def get(self, request: Request, episode_id: str) -> Response:
        episode = _episode(request, episode_id)
        return Response({"results": StepSerializer(episode.steps.all(), many=True).data})

    @extend_schema(
        request=StepAppendSerializer,
        responses={201: StepSerializer(many=True), **ERROR_RESPONSES},
        description="Appends steps. Exec steps name `sandbox_id` + `operation_id`: the "
        "control plane's operation record becomes the observation.",
    )
    def post(self, request: Request, episode_id: str) -> Response:
        episode = _episode(request, episode_id)
        serializer = StepAppendSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        steps = step_append(episode=episode, steps=serializer.to_inputs())
        return Response(
            {"results": StepSerializer(steps, many=True).data}, status=status.HTTP_201_CREATED
        )


class AttachSerializer(serializers.Serializer):  # type: ignore[type-arg]
    sandbox_id = serializers.CharField(max_length=63)
    generation = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)


class EpisodeSandboxView(APIView):
    @extend_schema(request=AttachSerializer, responses={200: EpisodeSerializer, **ERROR_RESPONSES})
    def post(self, request: Request, episode_id: str) -> Response:
        from apps.sandboxes.selectors import sandbox_get

        episode = _episode(request, episode_id)
        serializer = AttachSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        sandbox = sandbox_get(
            tenant=principal_of(request).tenant,
            sandbox_id=serializer.validated_data["sandbox_id"],
        )
        episode_attach_sandbox(
            episode=episode, sandbox=sandbox, generation=serializer.validated_data.get("generation")
        )
        return Response(EpisodeSerializer(episode).data)


class EpisodeCloseView(APIView):
    @extend_schema(
        request=EpisodeCloseSerializer,
        responses={200: EpisodeSerializer, **ERROR_RESPONSES},
        description="Closes the episode and applies failure attribution. Idempotent.",
    )
    def post(self, request: Request, episode_id: str) -> Response:
        episode = _episode(request, episode_id)
        serializer = EpisodeCloseSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        episode = episode_close(episode=episode, result=serializer.to_result())
        return Response(EpisodeSerializer(episode).data)


class EpisodeAttributeView(APIView):
    @extend_schema(request=None, responses={200: EpisodeSerializer, **ERROR_RESPONSES})
    def post(self, request: Request, episode_id: str) -> Response:
        episode = episode_attribute(episode=_episode(request, episode_id))
        return Response(EpisodeSerializer(episode).data)


class EpisodeRelabelView(APIView):
    @extend_schema(responses={200: RelabelRecordSerializer(many=True)})
    def get(self, request: Request, episode_id: str) -> Response:
        episode = _episode(request, episode_id)
        relabels = selectors.episode_relabels(episode=episode)
        return Response({"results": RelabelRecordSerializer(relabels, many=True).data})

    @extend_schema(
        request=RelabelSerializer,
        responses={200: EpisodeSerializer, **ERROR_RESPONSES},
        description="A person sets the failure class (reason required). The automatic "
        "label is kept in `auto_failure_class`; every relabel is in the audit trail.",
    )
    def post(self, request: Request, episode_id: str) -> Response:
        principal = principal_of(request)
        episode = _episode(request, episode_id)
        serializer = RelabelSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        episode = episode_relabel(
            episode=episode,
            failure_class=serializer.validated_data["failure_class"],
            reason=serializer.validated_data["reason"],
            actor=principal.actor,
        )
        return Response(EpisodeSerializer(episode).data)


class EpisodeTimelineView(APIView):
    @extend_schema(responses={200: dict})
    def get(self, request: Request, episode_id: str) -> Response:
        episode = _episode(request, episode_id)
        items = selectors.episode_timeline(episode=episode)
        return Response({"results": [TimelineItemSerializer(item).data for item in items]})


class EpisodeBranchAdviceView(APIView):
    @extend_schema(
        responses={200: dict, **ERROR_RESPONSES},
        parameters=[
            OpenApiParameter("k", int, description="continuations wanted (default 8)"),
            OpenApiParameter("step", int, description="branch after this step (default: last)"),
        ],
        description="Snapshot-and-fork (C_s + K·C_r) against replaying the prefix (K·C_p), "
        "from this episode's recorded step durations and the measured captures and "
        "restores of its sandboxes (docs/snapshots.md).",
    )
    def get(self, request: Request, episode_id: str) -> Response:
        from apps.trajectories.services.branching import episode_branch_advice

        episode = _episode(request, episode_id)
        try:
            k = int(request.query_params.get("k", 8))
            raw_step = request.query_params.get("step")
            step = int(raw_step) if raw_step else None
        except ValueError:
            raise ApiError("k and step must be integers", field="k") from None
        return Response(episode_branch_advice(episode=episode, k=k, step=step))


class EpisodeBranchesView(APIView):
    @extend_schema(responses={200: EpisodeSerializer(many=True), **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str) -> Response:
        """The episodes that branch from this one (oldest first): the tree's next level."""
        episode = _episode(request, episode_id)
        branches = episode.branches.order_by("started_at", "id").select_related("parent")
        return Response({"results": EpisodeSerializer(branches, many=True).data})


class EpisodeCounterfactualView(APIView):
    @extend_schema(
        responses={200: dict, **ERROR_RESPONSES},
        parameters=[
            OpenApiParameter("step", int, required=True, description="the branch step t"),
            OpenApiParameter("label", str, description="the label naming the arm (arm)"),
            OpenApiParameter("plus", str, description="its value on τ⁺ branches (with)"),
            OpenApiParameter("minus", str, description="its value on τ⁻ branches (without)"),
        ],
        description="Δ_t = mean R(τ⁺) − mean R(τ⁻) over this episode's closed branches at "
        "step t, with Welch's 95 % interval; infrastructure failures are left out by class.",
    )
    def get(self, request: Request, episode_id: str) -> Response:
        from apps.trajectories.services.branching import episode_counterfactual

        episode = _episode(request, episode_id)
        params = request.query_params
        try:
            step = int(params["step"])
        except (KeyError, ValueError):
            raise ApiError("step (an integer) is required", field="step") from None
        return Response(
            episode_counterfactual(
                episode=episode,
                step=step,
                label=params.get("label", "arm"),
                plus=params.get("plus", "with"),
                minus=params.get("minus", "without"),
            )
        )
