"""Trajectory pages: the list with its numbers, one episode's timeline, and a side by
side comparison. Reads go through selectors, the relabel form through the service."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from apps.core.errors import ApiError
from apps.tenancy.pages import page, render_page
from apps.tenancy.principal import Principal
from apps.trajectories import selectors
from apps.trajectories.models import INVALID_CLASSES, EpisodeStatus, FailureClass
from apps.trajectories.services.episodes import episode_relabel

PAGE_SIZE = 50
# The per-task table shows this many tasks (those with the most rollouts) when there are
# more: a team's tasks grow with its history, and 500 rows cost more to render than the
# rest of the page. The task filter reaches any other; the summary counts all of them.
TASKS_SHOWN = 50
CLASS_ORDER = [c.value for c in FailureClass]


def _chart(by_class: dict[str, int]) -> list[dict[str, Any]]:
    """Bars for the per-class chart, widths relative to the biggest class."""
    top = max(by_class.values(), default=0) or 1
    return [
        {
            "name": cls,
            "count": by_class.get(cls, 0),
            "pct": round(100 * by_class.get(cls, 0) / top, 1),
            "invalid": cls in INVALID_CLASSES,
        }
        for cls in CLASS_ORDER
    ]


def _tasks_shown(per_task: list[selectors.TaskSuccess]) -> list[selectors.TaskSuccess]:
    """The per-task rows the page shows: every task, or the ``TASKS_SHOWN`` with the
    most rollouts, in task order."""
    if len(per_task) <= TASKS_SHOWN:
        return per_task
    top = sorted(per_task, key=lambda t: (-t.rollouts, t.task_id))[:TASKS_SHOWN]
    return sorted(top, key=lambda t: t.task_id)


@require_GET
@page()
def episode_list_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    filters = {k: request.GET.get(k, "") for k in selectors.FILTER_PARAMS}
    search = request.GET.get("q", "").strip()
    sort = request.GET.get("sort", "newest")
    if sort not in selectors.EPISODE_SORTS:
        sort = "newest"
    cursor = request.GET.get("cursor", "")
    next_cursor = ""
    try:
        qs = selectors.episode_search(
            selectors.episode_list(tenant=principal.tenant, filters=filters), search
        )
        numbers = selectors.episode_numbers(tenant=principal.tenant, filters=filters, search=search)
        stats, stats_scanned = numbers.stats, numbers.scanned
        cost_as_stored = numbers.cost_as_stored
        # the rows show nothing of their sandboxes: no prefetch of the links
        listed = selectors.episode_page(qs, sort=sort, cursor=cursor, limit=PAGE_SIZE)
        episodes, next_cursor = listed.rows, listed.next_cursor
        error = ""
    except ApiError as exc:
        qs, stats, stats_scanned, episodes, error = None, None, None, [], exc.message
        cost_as_stored = 0
    # the same filters, search and sort on every page link; only the cursor changes
    keep = request.GET.copy()
    keep.pop("cursor", None)
    next_query = ""
    if next_cursor:
        keep["cursor"] = next_cursor
        next_query = keep.urlencode()
        keep.pop("cursor", None)
    return render_page(
        request,
        principal,
        "trajectories/list.html",
        {
            "nav_section": "trajectories",
            "filters": filters,
            "filter_error": error,
            "stats": stats,
            "stats_scanned": stats_scanned,
            "cost_as_stored": cost_as_stored,
            "chart": _chart(stats.by_class) if stats else [],
            "per_task": _tasks_shown(stats.per_task) if stats else [],
            "tasks_shown": TASKS_SHOWN,
            "episodes": episodes,
            "classes": CLASS_ORDER,
            "statuses": [s.value for s in EpisodeStatus],
            "tasks": selectors.task_ids(tenant=principal.tenant),
            "page_size": PAGE_SIZE,
            "search": search,
            "sort": sort,
            "sorts": [("newest", "Newest first"), ("oldest", "Oldest first")],
            "paged": bool(cursor),
            "first_query": keep.urlencode(),
            "next_query": next_query,
        },
    )


@require_GET
@page()
def episode_detail_page(
    request: HttpRequest, principal: Principal, episode_id: str
) -> HttpResponse:
    episode = selectors.episode_get(tenant=principal.tenant, episode_id=episode_id)
    siblings = (
        selectors.episode_list(tenant=principal.tenant, filters={"task": episode.task_id})
        .exclude(pk=episode.pk)
        .values_list("episode_id", flat=True)[:20]
    )
    return render_page(
        request,
        principal,
        "trajectories/detail.html",
        {
            "nav_section": "trajectories",
            "episode": episode,
            "timeline": selectors.episode_timeline(episode=episode),
            "relabels": list(selectors.episode_relabels(episode=episode)),
            "reattributions": list(selectors.episode_reattributions(episode=episode)),
            "classes": CLASS_ORDER,
            "siblings": list(siblings),
        },
    )


@require_POST
@page("write")
def episode_relabel_page(
    request: HttpRequest, principal: Principal, episode_id: str
) -> HttpResponse:
    episode = selectors.episode_get(tenant=principal.tenant, episode_id=episode_id)
    try:
        episode_relabel(
            episode=episode,
            failure_class=request.POST.get("failure_class", ""),
            reason=request.POST.get("reason", ""),
            actor=principal.actor,
        )
        messages.success(request, f"Relabeled {episode.episode_id} as {episode.failure_class}.")
    except ApiError as exc:
        messages.error(request, exc.message)
    return redirect("trajectories:episode", episode_id=episode.episode_id)


@require_GET
@page()
def episode_compare_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    a = selectors.episode_get(tenant=principal.tenant, episode_id=request.GET.get("a", ""))
    b = selectors.episode_get(tenant=principal.tenant, episode_id=request.GET.get("b", ""))
    try:
        pairs = selectors.episode_compare(a=a, b=b)
        error = ""
    except ApiError as exc:
        pairs, error = [], exc.message
    return render_page(
        request,
        principal,
        "trajectories/compare.html",
        {"nav_section": "trajectories", "a": a, "b": b, "pairs": pairs, "error": error},
    )
