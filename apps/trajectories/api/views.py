from __future__ import annotations

from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import parsers, serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import ApiError, ValidationFailed
from apps.core.keyset import CURSOR_DOCS, api_keyset_page, api_page_size
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES
from apps.sandboxes.selectors import sandbox_get
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

# the tombstone list answered its newest 500 and dropped the rest: 500 a page now
TOMBSTONE_PAGE = 500
# an episode's steps came in one answer, however many: 1,000 a page now
STEP_PAGE = 1000

FILTER_DOCS = [
    OpenApiParameter(name, str, description="comma = any of") for name in selectors.EXACT_FILTERS
] + [
    OpenApiParameter("since", str, description="ISO time, started at or after"),
    OpenApiParameter("until", str, description="ISO time, started before"),
    OpenApiParameter("label", str, description="key=value or key"),
    OpenApiParameter("relabeled", bool),
    OpenApiParameter("provenance_key", str, description="comma = any of"),
    OpenApiParameter("provenance_origin", str, description="comma = any of"),
    OpenApiParameter(
        "provenance.<component>",
        str,
        description="task, image, snapshot, policy, harness, verifier, sampling or attempt "
        "(comma = any of; `unknown` matches a missing component)",
    ),
]


def _filters(request: Request) -> dict[str, str]:
    return selectors.filter_params(request.query_params)


def _episode(request: Request, episode_id: str) -> Episode:
    return selectors.episode_get(tenant=principal_of(request).tenant, episode_id=episode_id)


class EpisodeListCreateView(APIView):
    @extend_schema(
        responses={200: EpisodeSerializer(many=True)},
        parameters=[
            *FILTER_DOCS,
            OpenApiParameter(
                "cursor",
                str,
                description="keyset paging: empty for the first page, then the previous "
                "page's next_cursor",
            ),
        ],
        description="Newest first. With `cursor` (empty for the first page): one keyset "
        "page, `results` and `next_cursor` (null on the last page), no count — a walk "
        "returns every episode once however many there are. Without it: offset pages "
        "(`limit`/`offset`, `count`, `next`), whose deep pages read every row before them.",
    )
    def get(self, request: Request) -> Response:
        qs = selectors.episode_list(tenant=principal_of(request).tenant, filters=_filters(request))
        qs = qs.prefetch_related("sandbox_links", "relabels", "reattributions")
        if "cursor" in request.query_params:
            rows, next_cursor = selectors.episode_keyset_page(
                qs,
                cursor=request.query_params.get("cursor", ""),
                limit=api_page_size(request.query_params.get("limit")),
            )
            return Response(
                {"results": EpisodeSerializer(rows, many=True).data, "next_cursor": next_cursor}
            )
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(qs, request, view=self)
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
            raw=request.data,
        )
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(EpisodeSerializer(episode).data, status=code)


class EpisodeProvenanceView(APIView):
    @extend_schema(
        responses={200: dict, **ERROR_RESPONSES},
        parameters=[
            OpenApiParameter(
                "group_by",
                str,
                required=True,
                description="comma-separated provenance components, or `origin`",
            ),
            *FILTER_DOCS,
        ],
        description="Episodes grouped by provenance components: per group the values, "
        "episodes, closed, valid and successes.",
    )
    def get(self, request: Request) -> Response:
        group_by = [g for g in request.query_params.get("group_by", "").split(",") if g]
        qs = selectors.episode_list(tenant=principal_of(request).tenant, filters=_filters(request))
        groups = selectors.episode_provenance_groups(episodes=qs, group_by=group_by)
        return Response({"group_by": group_by, "groups": groups})


class EpisodeStatsView(APIView):
    @extend_schema(
        responses={200: dict},
        parameters=FILTER_DOCS,
        description="η = valid/N, cost per valid episode = cost/(N·η), success raw and "
        "conditional on valid infrastructure, per-task success (tasks, not rollouts).",
    )
    def get(self, request: Request) -> Response:
        stats = selectors.episode_stats_exact(
            tenant=principal_of(request).tenant, filters=_filters(request)
        )
        return Response(stats.as_dict())


class EpisodeExportView(APIView):
    @extend_schema(
        responses={(200, "application/x-ndjson"): str},
        parameters=FILTER_DOCS,
        description="JSONL, one `hedgerow.episode/v1` record per line (docs/trajectories.md).",
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        principal = principal_of(request)
        filters = _filters(request)
        qs = selectors.episode_list(tenant=principal.tenant, filters=filters)
        recorded_as = {"tenant": principal.tenant, "actor": principal.actor, "filters": filters}
        response = StreamingHttpResponse(
            episodes_export(episodes=qs, recorded_as=recorded_as),
            content_type="application/x-ndjson",
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
    @extend_schema(
        responses={200: StepSerializer(many=True)},
        parameters=CURSOR_DOCS,
        description=f"The episode's steps in order, {STEP_PAGE} a page by default (`limit` "
        f"1–{STEP_PAGE}); `next_cursor` (null on the last page) is the `cursor` of the "
        "next page.",
    )
    def get(self, request: Request, episode_id: str) -> Response:
        episode = _episode(request, episode_id)
        size = api_page_size(request.query_params.get("limit"), default=STEP_PAGE, most=STEP_PAGE)
        steps = episode.steps.order_by("index")
        cursor = request.query_params.get("cursor", "")
        if cursor:
            # the last index of the page before: a plain number, the steps' own key
            if not cursor.isdigit():
                raise ValidationFailed("cursor is not a cursor this server gave", field="cursor")
            steps = steps.filter(index__gt=int(cursor))
        rows = list(steps[: size + 1])
        next_cursor = str(rows[size - 1].index) if len(rows) > size else None
        return Response(
            {"results": StepSerializer(rows[:size], many=True).data, "next_cursor": next_cursor}
        )

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
        steps = step_append(episode=episode, steps=serializer.to_inputs(), raw=request.data)
        return Response(
            {"results": StepSerializer(steps, many=True).data}, status=status.HTTP_201_CREATED
        )


class AttachSerializer(serializers.Serializer):  # type: ignore[type-arg]
    sandbox_id = serializers.CharField(max_length=63)
    generation = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)


class EpisodeSandboxView(APIView):
    @extend_schema(request=AttachSerializer, responses={200: EpisodeSerializer, **ERROR_RESPONSES})
    def post(self, request: Request, episode_id: str) -> Response:
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
        episode = episode_close(episode=episode, result=serializer.to_result(), raw=request.data)
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


# -- redaction: the admin's read (audited), the report, a dry-run scan ---------------


class EpisodeSecretsView(APIView):
    required_scope = "admin"

    @extend_schema(
        responses={200: dict, **ERROR_RESPONSES},
        description="The episode's placeholder → secret mapping, decrypted. Tenant admins "
        "only (`admin` scope); every read is written to the audit (`/episodes/secrets/"
        "access`) before the values are returned.",
    )
    def get(self, request: Request, episode_id: str) -> Response:
        from apps.trajectories.services.secrets import episode_secrets_reveal

        principal = principal_of(request)
        episode = _episode(request, episode_id)
        rows = episode_secrets_reveal(episode=episode, actor=principal.actor)
        response = Response({"episode_id": episode.episode_id, "results": rows})
        response["Cache-Control"] = "no-store"
        return response


class SecretAccessView(APIView):
    required_scope = "admin"

    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        """Who read which episode's secrets, newest first (the audit)."""
        from apps.trajectories.models import SecretAccess

        rows = SecretAccess.objects.filter(tenant=principal_of(request).tenant)[:500]
        return Response(
            {
                "results": [
                    {
                        "episode_id": r.episode_ref,
                        "actor": r.actor,
                        "placeholders": r.placeholders,
                        "at": r.at,
                    }
                    for r in rows
                ]
            }
        )


class SecretsReportView(APIView):
    @extend_schema(
        responses={200: dict},
        parameters=FILTER_DOCS,
        description="What redaction found in the matching episodes, by kind: distinct "
        "secrets, occurrences, episodes. No values.",
    )
    def get(self, request: Request) -> Response:
        from apps.trajectories.services.secrets import secrets_report

        tenant = principal_of(request).tenant
        qs = selectors.episode_list(tenant=tenant, filters=_filters(request))
        return Response(secrets_report(tenant=tenant, episodes=qs))


class EpisodeScanView(APIView):
    parser_classes = [RawBodyParser]
    required_scope = "read"  # a dry run: it stores nothing

    @extend_schema(
        request={"application/x-ndjson": str},
        responses={200: dict, **ERROR_RESPONSES},
        description="Scans a body (JSONL, one JSON value per line; a line that is not "
        "JSON is scanned as text) for secrets and reports them by kind, with the paths "
        "where they were found. Nothing is stored; no values are returned.",
    )
    def post(self, request: Request) -> Response:
        from apps.trajectories.services.secrets import scan_lines

        body = request.data if isinstance(request.data, bytes) else b""
        return Response(scan_lines(body.splitlines()))


# -- lineage --------------------------------------------------------------------------


class EpisodeLineageView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str) -> Response:
        """The episode's raw events (without bodies) and every layer derived from them."""
        from apps.trajectories.services import lineage

        return Response(lineage.episode_lineage(episode=_episode(request, episode_id)))


class EpisodeRawEventsView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str) -> Response:
        """What the harness sent, as received (secrets already replaced), in order."""
        from apps.trajectories.models import RawEvent
        from apps.trajectories.services import lineage

        episode = _episode(request, episode_id)
        events = RawEvent.objects.filter(episode=episode)
        return Response({"results": [lineage.raw_event_record_dict(e) for e in events]})


class LayerCreateSerializer(serializers.Serializer):  # type: ignore[type-arg]
    kind = serializers.CharField(max_length=16)
    producer = serializers.CharField(max_length=200, required=False, allow_blank=True)
    producer_version = serializers.CharField(max_length=100, required=False, allow_blank=True)
    schema_version = serializers.CharField(max_length=100, required=False, allow_blank=True)
    source_layer = serializers.CharField(max_length=64, required=False, allow_blank=True)
    params = serializers.DictField(required=False)
    items = serializers.ListField(child=serializers.JSONField(), required=False)
    # the server's own parser (normalized only): {"parser", "parser_version"}
    parser = serializers.CharField(max_length=200, required=False)
    parser_version = serializers.CharField(max_length=100, required=False)


class EpisodeLayersView(APIView):
    @extend_schema(
        request=LayerCreateSerializer,
        responses={201: dict, **ERROR_RESPONSES},
        description="Appends a layer: `normalized` (items name `raw_events`, or "
        "`parser`+`parser_version` runs the server's parser), `segments` (from a "
        "normalized `source_layer`; items `steps: [first, last]`, `reason`, `evidence`, "
        "`reward`) or `packed` (from a segments layer; `params.tokenizer` and "
        "`params.chat_template` required; items name `segments`). Layers are versioned "
        "per kind; earlier ones stay.",
    )
    def post(self, request: Request, episode_id: str) -> Response:
        from apps.trajectories.services import lineage

        principal = principal_of(request)
        episode = _episode(request, episode_id)
        serializer = LayerCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if "parser" in data:
            if data["kind"] != "normalized":
                raise ApiError("only a normalized layer has a parser", field="parser")
            layer = lineage.normalize(
                episode=episode,
                actor=principal.actor,
                parser=data["parser"],
                parser_version=data.get("parser_version", ""),
            )
        else:
            layer = lineage.layer_create(
                episode=episode,
                kind=data["kind"],
                producer=data.get("producer", ""),
                producer_version=data.get("producer_version", ""),
                schema_version=data.get("schema_version", ""),
                source_layer=data.get("source_layer") or None,
                params=data.get("params") or {},
                items=data.get("items") or [],
                actor=principal.actor,
            )
        return Response(lineage.layer_summary(layer), status=status.HTTP_201_CREATED)


class EpisodeLayerDetailView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str, layer_id: str) -> Response:
        """A layer and its items."""
        from apps.trajectories.services import lineage

        layer = lineage.layer_get(episode=_episode(request, episode_id), layer_id=layer_id)
        return Response(
            {
                **lineage.layer_summary(layer),
                "results": [lineage.item_record(i) for i in layer.items.select_related("layer")],
            }
        )


class LayerItemTraceView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str, layer_id: str, position: int) -> Response:
        """From one item (a packed sample, a segment, a normalized step) down through
        every layer it came from to the raw events."""
        from apps.trajectories.services import lineage

        episode = _episode(request, episode_id)
        return Response(lineage.trace(episode=episode, layer_id=layer_id, position=position))


class WithdrawalSerializer(serializers.Serializer):  # type: ignore[type-arg]
    task_id = serializers.CharField(max_length=200, required=False)
    episode_ids = serializers.ListField(
        child=serializers.CharField(max_length=64), required=False, max_length=10000
    )
    label = serializers.CharField(  # type: ignore[assignment]
        max_length=300, required=False, help_text="key=value"
    )
    reason = serializers.CharField(max_length=10000)


class WithdrawalView(APIView):
    required_scope = "admin"

    @extend_schema(
        request=WithdrawalSerializer,
        responses={201: dict, **ERROR_RESPONSES},
        description="A deletion request for a withdrawn task (`task_id`), a withdrawn "
        "source (`label`: key=value) or `episode_ids`: every layer derived from their "
        "raw events is found through the lineage, with the exports that held them and "
        "what registered dependents (datasets, analyses) report; all of it is deleted "
        "and a tombstone is left.",
    )
    def post(self, request: Request) -> Response:
        from apps.trajectories.services import lineage

        principal = principal_of(request)
        serializer = WithdrawalSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        reason = data.pop("reason")
        tombstone = lineage.withdraw(
            tenant=principal.tenant, request=data, reason=reason, actor=principal.actor
        )
        return Response(_tombstone(tombstone), status=status.HTTP_201_CREATED)


def _tombstone(t: Any) -> dict[str, Any]:
    return {
        "id": str(t.pk),
        "request": t.request,
        "reason": t.reason,
        "actor": t.actor,
        "removed": t.removed,
        "affects": t.affects,
        "at": t.at,
    }


class TombstoneListView(APIView):
    @extend_schema(
        responses={200: dict},
        parameters=CURSOR_DOCS,
        description="Deletions: what each removed and what it affects, newest first, "
        f"{TOMBSTONE_PAGE} a page by default (`limit` 1–{TOMBSTONE_PAGE}); `next_cursor` "
        "(null on the last page) is the `cursor` of the next page.",
    )
    def get(self, request: Request) -> Response:
        from apps.trajectories.services import lineage

        rows, next_cursor = api_keyset_page(
            lineage.tombstones(tenant=principal_of(request).tenant),
            cursor=request.query_params.get("cursor", ""),
            limit=request.query_params.get("limit"),
            default=TOMBSTONE_PAGE,
            most=TOMBSTONE_PAGE,
            time_field="at",
        )
        return Response({"results": [_tombstone(t) for t in rows], "next_cursor": next_cursor})
