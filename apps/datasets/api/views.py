"""REST: datasets (splits, cards, exports), tasks (metadata, difficulty, reference runs,
quarantine), the harness × policy matrix and where episodes' time goes."""

from __future__ import annotations

import json
import math
from typing import Any

from django.db import transaction
from django.http import HttpResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.errors import NotFound, ValidationFailed
from apps.core.keyset import API_PAGE_MAX, CURSOR_DOCS, api_key_page, api_keyset_page
from apps.datasets import selectors
from apps.datasets.models import Dataset, ReferenceRun, Task
from apps.datasets.services.cards import dataset_card
from apps.datasets.services.difficulty import Prior
from apps.datasets.services.matrix import episode_matrix
from apps.datasets.services.reference_check import reference_check_request
from apps.datasets.services.splits import (
    DEFAULT_FRACTIONS,
    DatasetSpec,
    dataset_as_dict,
    dataset_create,
    dataset_episodes,
    dataset_get,
)
from apps.datasets.services.tasks import reference_as_dict, reference_record, task_get, task_upsert
from apps.datasets.services.timing import AGGREGATE_LIMIT, episode_time, episodes_time
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES
from apps.tenancy.permissions import principal_of
from apps.trajectories import selectors as episode_selectors
from apps.trajectories.services.transfer import episodes_export

# a team's task list came in one answer of up to 1,000 before it was paged: the same by
# default, so a client that reads one page of a small registry sees no change
TASK_PAGE = 1000


def _episode_filters(params: Any) -> dict[str, str]:
    return {k: params[k] for k in episode_selectors.FILTER_PARAMS if k in params}


def _body(request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise ValidationFailed("the body is a JSON object")
    return request.data


def _positive(params: Any, name: str, default: float) -> float:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValidationFailed(f"{name} is a number", field=name) from None
    if not math.isfinite(value) or value <= 0:
        raise ValidationFailed(f"{name} must be > 0", field=name)
    return value


def _prior(params: Any) -> Prior:
    default = Prior.default()
    return Prior(
        _positive(params, "alpha0", default.alpha0), _positive(params, "beta0", default.beta0)
    )


def _int(params: Any, name: str, default: int) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValidationFailed(f"{name} is a whole number", field=name) from None


def spec_from(data: dict[str, Any]) -> DatasetSpec:
    filters = data.get("filters") or {}
    if not isinstance(filters, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in filters.items()
    ):
        raise ValidationFailed("filters is an object of strings", field="filters")
    fractions = data.get("fractions", DEFAULT_FRACTIONS)
    if not isinstance(fractions, dict):
        raise ValidationFailed("fractions is an object", field="fractions")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValidationFailed("seed is a whole number", field="seed")
    name = data.get("name", "")
    if not isinstance(name, str) or len(name) > 200:
        raise ValidationFailed("name is a string of at most 200 characters", field="name")
    temporal = data.get("temporal")
    if temporal is not None and not isinstance(temporal, dict):
        raise ValidationFailed("temporal is an object", field="temporal")
    valid_only = data.get("valid_only", False)
    if not isinstance(valid_only, bool):
        raise ValidationFailed("valid_only is a boolean", field="valid_only")
    group_by = data.get("group_by", "task")
    if not isinstance(group_by, str):
        raise ValidationFailed("group_by is a string", field="group_by")
    return DatasetSpec(
        name=name,
        filters=filters,
        group_by=group_by,
        fractions={**{s: 0.0 for s in ("train", "validation", "test")}, **fractions},
        seed=seed,
        valid_only=valid_only,
        temporal=temporal,
    )


class DatasetListCreateView(APIView):
    @extend_schema(
        operation_id="v1_datasets_list",
        responses={200: dict},
        parameters=CURSOR_DOCS,
        description="The team's datasets, newest first, 200 a page by default (`limit` "
        f"1–{API_PAGE_MAX}); `next_cursor` (null on the last page) is the `cursor` of the "
        "next page.",
    )
    def get(self, request: Request) -> Response:
        rows, next_cursor = api_keyset_page(
            Dataset.objects.filter(tenant=principal_of(request).tenant),
            cursor=request.query_params.get("cursor", ""),
            limit=request.query_params.get("limit"),
            default=API_PAGE_MAX,
        )
        return Response({"results": [dataset_as_dict(d) for d in rows], "next_cursor": next_cursor})

    @extend_schema(
        request=dict,
        responses={201: dict, **ERROR_RESPONSES},
        description="Builds train/validation/test splits from an episode filter, grouping by "
        "`group_by` (task, repo_commit, affected_files, failing_tests, image_digest) so that "
        "related episodes never straddle splits (docs/datasets.md).",
    )
    def post(self, request: Request) -> Response:
        principal = principal_of(request)
        dataset = dataset_create(
            tenant=principal.tenant, spec=spec_from(_body(request)), actor=principal.actor
        )
        return Response(dataset_as_dict(dataset), status=status.HTTP_201_CREATED)


class DatasetDetailView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, dataset_id: str) -> Response:
        dataset = dataset_get(tenant=principal_of(request).tenant, dataset_id=dataset_id)
        return Response(dataset_as_dict(dataset))


class DatasetCardView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, dataset_id: str) -> Response:
        dataset = dataset_get(tenant=principal_of(request).tenant, dataset_id=dataset_id)
        return Response(dataset_card(dataset))


class DatasetExportView(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("split", str, required=True)],
        responses={(200, "application/x-ndjson"): str, **ERROR_RESPONSES},
        description="One split as JSONL (`hedgerow.episode/v1` records), streamed.",
    )
    def get(self, request: Request, dataset_id: str) -> StreamingHttpResponse:
        dataset = dataset_get(tenant=principal_of(request).tenant, dataset_id=dataset_id)
        split = request.query_params.get("split", "")
        episodes = dataset_episodes(dataset=dataset, split=split)
        response = StreamingHttpResponse(
            episodes_export(episodes=episodes), content_type="application/x-ndjson"
        )
        response["Content-Disposition"] = (
            f'attachment; filename="{dataset.dataset_id}-{split}.jsonl"'
        )
        return response


class TaskListView(APIView):
    @extend_schema(
        operation_id="v1_tasks_list",
        responses={200: dict},
        parameters=CURSOR_DOCS,
        description=f"The team's tasks by task id, {TASK_PAGE} a page by default (`limit` "
        f"1–{TASK_PAGE}); `next_cursor` (null on the last page) is the `cursor` of the next "
        "page.",
    )
    def get(self, request: Request) -> Response:
        rows, next_cursor = api_key_page(
            Task.objects.filter(tenant=principal_of(request).tenant),
            key="task_id",
            cursor=request.query_params.get("cursor", ""),
            limit=request.query_params.get("limit"),
            default=TASK_PAGE,
            most=TASK_PAGE,
        )
        return Response(
            {"results": [selectors.task_as_dict(t) for t in rows], "next_cursor": next_cursor}
        )


class TaskDetailView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, task_id: str) -> Response:
        task = task_get(tenant=principal_of(request).tenant, task_id=task_id)
        return Response(selectors.task_as_dict(task))

    @extend_schema(
        request=dict,
        responses={200: dict, 201: dict, **ERROR_RESPONSES},
        description="Registers (or replaces) a task's metadata (`repo`, `base_commit`, "
        "`affected_files`, `failing_tests`, `created_at`, `fix_merged_at`, anything else) "
        "and `licence`; `reference` registers the reference solution, verifier and image, "
        'and queues its reference check (docs/trajectories.md, "Verifier health").',
    )
    def put(self, request: Request, task_id: str) -> Response:
        data = _body(request)
        principal = principal_of(request)
        with transaction.atomic():  # an image the team cannot have: nothing is registered
            task, created = task_upsert(
                tenant=principal.tenant,
                task_id=task_id,
                metadata=data.get("metadata"),
                licence=data.get("licence"),
                reference=data.get("reference"),
            )
            body = selectors.task_as_dict(task)
            if task.reference:
                # a new task version, image or verifier version is a new key: checked;
                # an unchanged one is the cached run (no sandbox)
                run, _ = reference_check_request(
                    tenant=principal.tenant, task_id=task_id, actor=principal.actor
                )
                body["reference_check"] = reference_as_dict(run)
        return Response(
            body,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


BULK_DOCS = [
    OpenApiParameter("ids", str, description="comma-separated task ids; omitted: every task"),
    OpenApiParameter("family", str, description="only this policy family"),
    OpenApiParameter("alpha0", float),
    OpenApiParameter("beta0", float),
]


def _bulk(request: Request, ids: list[str] | None) -> HttpResponse:
    if ids is not None and len(ids) > selectors.MAX_BULK_IDS:
        raise ValidationFailed(f"at most {selectors.MAX_BULK_IDS} ids", field="ids")
    if ids is not None and any(selectors.ID_SEPARATOR in i for i in ids):
        raise ValidationFailed("a task id has no control characters", field="ids")
    params = request.query_params
    return HttpResponse(
        selectors.difficulty_bulk_json(
            tenant=principal_of(request).tenant,
            ids=ids,
            prior=_prior(params),
            family=params.get("family") or None,
        ),
        content_type="application/json",
    )


class TaskDifficultyBulkView(APIView):
    @extend_schema(
        operation_id="v1_tasks_difficulty_bulk",
        parameters=BULK_DOCS,
        responses={200: dict, **ERROR_RESPONSES},
    )
    def get(self, request: Request) -> HttpResponse:
        raw = request.query_params.get("ids")
        return _bulk(request, None if raw is None else [i for i in raw.split(",") if i])

    @extend_schema(
        request=dict,
        parameters=BULK_DOCS[1:],
        responses={200: dict, **ERROR_RESPONSES},
        description='The same with `{"ids": [...]}` in the body: for id lists too long for a URL.',
    )
    def post(self, request: Request) -> HttpResponse:
        # read straight from the body: 10,000 ids through DRF's guarded parser cost more
        # than the query (Django bounds the body: DATA_UPLOAD_MAX_MEMORY_SIZE)
        try:
            data = json.loads(request.body)
        except (ValueError, UnicodeDecodeError):
            raise ValidationFailed("the body is JSON", field="ids") from None
        ids = data.get("ids") if isinstance(data, dict) else None
        if not isinstance(ids, list) or not all(
            isinstance(i, str) and "\x00" not in i for i in ids
        ):
            raise ValidationFailed("ids is a list of task ids", field="ids")
        return _bulk(request, ids)

    # a POST here only reads: a read-scoped key may call it
    required_scope = "read"


class TaskDifficultyView(APIView):
    @extend_schema(parameters=BULK_DOCS[2:], responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, task_id: str) -> Response:
        return Response(
            selectors.task_difficulty(
                tenant=principal_of(request).tenant,
                task_id=task_id,
                prior=_prior(request.query_params),
            )
        )


class TaskQuarantineView(APIView):
    @extend_schema(responses={200: dict})
    def get(self, request: Request) -> Response:
        return Response({"results": selectors.quarantine_list(tenant=principal_of(request).tenant)})


class ReferenceRunView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, task_id: str) -> Response:
        body = selectors.task_difficulty(
            tenant=principal_of(request).tenant, task_id=task_id, prior=Prior.default()
        )
        return Response({"results": body["reference_runs"]})

    @extend_schema(
        request=dict,
        responses={201: dict, **ERROR_RESPONSES},
        description="Records the verifier's result on the reference solution (and on the "
        "initial state) for (task_version, image_digest, verifier_version): "
        "`reference_episode_id` (the control plane's class decides) or `reference_outcome`.",
    )
    def post(self, request: Request, task_id: str) -> Response:
        principal = principal_of(request)
        run = reference_record(
            tenant=principal.tenant, task_id=task_id, data=_body(request), actor=principal.actor
        )
        return Response(reference_as_dict(run), status=status.HTTP_201_CREATED)


class ReferenceCheckView(APIView):
    @extend_schema(
        responses={200: dict, **ERROR_RESPONSES},
        description="The task's latest reference check: `status` queued, running, done or "
        "error, with each run's exit code, verdict and per-test vector in `detail`.",
    )
    def get(self, request: Request, task_id: str) -> Response:
        tenant = principal_of(request).tenant
        task_get(tenant=tenant, task_id=task_id)
        run = (
            ReferenceRun.objects.filter(tenant=tenant, task_id=task_id, source="check")
            .order_by("-recorded_at", "-id")
            .first()
        )
        if run is None:
            raise NotFound(f"task {task_id!r} was never checked", code="reference_check_not_found")
        return Response(reference_as_dict(run))

    @extend_schema(
        request=None,
        responses={200: dict, 202: dict, **ERROR_RESPONSES},
        description="Runs the registered verifier on the task's initial state and on its "
        "reference solution in a new sandbox (202, `queued`), once per (task_version, "
        "image digest, verifier_version): a key already checked answers 200 with the "
        "cached run and makes no sandbox. A check that broke (`error`) is run again.",
    )
    def post(self, request: Request, task_id: str) -> Response:
        principal = principal_of(request)
        run, enqueued = reference_check_request(
            tenant=principal.tenant, task_id=task_id, actor=principal.actor
        )
        return Response(
            reference_as_dict(run),
            status=status.HTTP_202_ACCEPTED if enqueued else status.HTTP_200_OK,
        )


class EpisodeMatrixView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("policies", str, required=True, description="p0,p1"),
            OpenApiParameter("harnesses", str, required=True, description="A,B"),
            OpenApiParameter("tasks", str),
            OpenApiParameter(
                "policy_field", str, description="policy_version (default), model, model_version"
            ),
            OpenApiParameter("bootstrap", int, description="resamples (default 1000)"),
            OpenApiParameter("seed", int),
        ],
        responses={200: dict, **ERROR_RESPONSES},
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        return Response(
            episode_matrix(
                tenant=principal_of(request).tenant,
                policies=params.get("policies", ""),
                harnesses=params.get("harnesses", ""),
                tasks=params.get("tasks", ""),
                policy_field=params.get("policy_field", "policy_version"),
                filters=_episode_filters(params),
                resamples=_int(params, "bootstrap", 1000),
                seed=_int(params, "seed", 0),
            )
        )


class EpisodesTimeView(APIView):
    @extend_schema(operation_id="v1_episodes_time_list", responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request) -> Response:
        limit = _int(request.query_params, "limit", AGGREGATE_LIMIT)
        if not 1 <= limit <= 5000:
            raise ValidationFailed("limit is 1–5000", field="limit")
        qs = episode_selectors.episode_list(
            tenant=principal_of(request).tenant, filters=_episode_filters(request.query_params)
        )
        return Response(episodes_time(qs, limit=limit))


class EpisodeTimeView(APIView):
    @extend_schema(responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, episode_id: str) -> Response:
        episode = episode_selectors.episode_get(
            tenant=principal_of(request).tenant, episode_id=episode_id
        )
        return Response(episode_time(episode))
