"""Tenant-scoped reads of episodes, their numbers (η, cost per valid episode, success
raw and conditional, per-task success) and their timelines."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from itertools import zip_longest
from typing import Any

from django.db import connection
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Sum
from django.utils.dateparse import parse_datetime

from apps.core.errors import Conflict, NotFound, ValidationFailed
from apps.core.keyset import decode_cursor, encode_cursor
from apps.sandboxes.models import SandboxEvent
from apps.tenancy.models import Tenant
from apps.trajectories import provenance
from apps.trajectories.cost import QUANTUM, episodes_total_cost
from apps.trajectories.models import (
    INVALID_CLASSES,
    Episode,
    EpisodeRelabel,
    EpisodeStatus,
    FailureClass,
    Step,
)
from apps.trajectories.services.attribution import DETECTION_GRACE

# Query parameter → model field, for exact-match filters (comma = any of).
EXACT_FILTERS = {
    "task": "task_id",
    "task_version": "task_version",
    "model": "model",
    "harness": "harness",
    "policy_version": "policy_version",
    "status": "status",
    "failure_class": "failure_class",
    "auto_failure_class": "auto_failure_class",
    "attempt": "attempt_id",
}
FILTER_PARAMS = (*EXACT_FILTERS, "since", "until", "label", "relabeled")
# ``provenance.<component>=value[,value]`` filters on one provenance component
# (apps/trajectories/provenance.py); ``provenance_key`` / ``provenance_origin`` exactly.
PROVENANCE_PREFIX = "provenance."
PROVENANCE_KEYS = {"provenance_key": "provenance_key", "provenance_origin": "provenance_origin"}


def filter_params(params: Any) -> dict[str, str]:
    """The list filters in a query string: the fixed ones and every
    ``provenance.<component>`` (an unknown component is a 400)."""
    chosen = {k: params[k] for k in (*FILTER_PARAMS, *PROVENANCE_KEYS) if k in params}
    for name in params:
        if name.startswith(PROVENANCE_PREFIX):
            component = name[len(PROVENANCE_PREFIX) :]
            if component not in provenance.COMPONENTS:
                raise ValidationFailed(
                    f"unknown provenance component {component!r}; one of "
                    f"{', '.join(provenance.COMPONENTS)}",
                    field=name,
                )
            chosen[name] = params[name]
    return chosen


def _when(value: str, name: str) -> datetime:
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValidationFailed(f"{name} must be an ISO 8601 time", field=name)
    return parsed


def episode_keyset_page(
    qs: QuerySet[Episode], *, cursor: str, limit: int
) -> tuple[list[Episode], str | None]:
    """The API's keyset page of ``qs``, newest first: ``episode_page`` (the dashboard's),
    except that a cursor this server did not give is a 400 rather than a fresh start
    (a client must learn its cursor is wrong); the next cursor is None on the last page."""
    if cursor:
        after = decode_cursor(cursor)
        if after is None or after[0].tzinfo is None:
            raise ValidationFailed("cursor is not a cursor this server gave", field="cursor")
    page = episode_page(qs, sort="newest", cursor=cursor, limit=limit)
    return page.rows, page.next_cursor or None


def episode_list(*, tenant: Tenant, filters: dict[str, str] | None = None) -> QuerySet[Episode]:
    """Episodes of the tenant, newest first. ``label`` is ``key=value`` (or a bare key)
    on the episode's labels; ``relabeled=true`` keeps episodes a person relabeled."""
    qs = (
        Episode.objects.for_tenant(tenant)
        .select_related("parent")  # a branch names its parent's id
        .order_by("-started_at", "-created_at")
    )
    for param, value in (filters or {}).items():
        if not value:
            continue
        if param in EXACT_FILTERS:
            qs = qs.filter(**{f"{EXACT_FILTERS[param]}__in": value.split(",")})
        elif param == "since":
            qs = qs.filter(started_at__gte=_when(value, param))
        elif param == "until":
            qs = qs.filter(started_at__lt=_when(value, param))
        elif param == "label":
            key, _, wanted = value.partition("=")
            qs = (
                qs.filter(**{f"labels__{key}": wanted})
                if wanted
                else qs.filter(labels__has_key=key)
            )
        elif param == "relabeled":
            # EXISTS, not a join + DISTINCT: the same rows, and the set stays usable
            # as a bounded subquery (``episode_numbers``)
            has = value.lower() in ("1", "true", "yes")
            relabeled = Exists(EpisodeRelabel.objects.filter(episode=OuterRef("pk")))
            qs = qs.filter(relabeled if has else ~relabeled)
        elif param in PROVENANCE_KEYS:
            qs = qs.filter(**{f"{PROVENANCE_KEYS[param]}__in": value.split(",")})
        elif param.startswith(PROVENANCE_PREFIX):
            component = param[len(PROVENANCE_PREFIX) :]
            qs = qs.filter(**{f"provenance__{component}__in": value.split(",")})
    return qs


# The list page's orders: name -> (field, descending). Keyset pages on (field, id).
EPISODE_SORTS = {"newest": ("started_at", True), "oldest": ("started_at", False)}


@dataclass(frozen=True)
class EpisodePage:
    rows: list[Episode]
    next_cursor: str


def episode_search(episodes: QuerySet[Episode], term: str) -> QuerySet[Episode]:
    """Episodes whose id starts with ``term`` (with or without ``ep-``) or that carry
    ``term`` as a label value or key (exact, like the sandboxes list)."""
    term = term.strip()
    if not term:
        return episodes
    ident = term if term.startswith("ep-") else f"ep-{term}"
    return episodes.filter(
        Q(episode_id__startswith=ident)
        | Q(episode_id=term)
        | Q(labels__icontains=f'"{term}"')
        | Q(labels__has_key=term)
    )


def episode_page(
    episodes: QuerySet[Episode], *, sort: str = "newest", cursor: str = "", limit: int = 50
) -> EpisodePage:
    """One page of ``episodes`` (already tenant-scoped and filtered). Keyset pagination
    on (started_at, id): "next" stays right while episodes are recorded, which an offset
    would not. An unknown sort is newest first; a bad cursor starts over."""
    field_name, descending = EPISODE_SORTS.get(sort, EPISODE_SORTS["newest"])
    after = decode_cursor(cursor)
    if after is not None:
        last, pk = after
        op = "lt" if descending else "gt"
        episodes = episodes.filter(
            Q(**{f"{field_name}__{op}": last}) | Q(**{field_name: last, f"id__{op}": pk})
        )
    order = [f"-{field_name}", "-id"] if descending else [field_name, "id"]
    rows = list(episodes.order_by(*order)[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = ""
    if more:
        last_row = rows[-1]
        next_cursor = encode_cursor(getattr(last_row, field_name), last_row.pk)
    return EpisodePage(rows, next_cursor)


def episode_provenance_groups(
    *, episodes: QuerySet[Episode], group_by: list[str]
) -> list[dict[str, Any]]:
    """Episodes grouped by provenance components (``origin`` = every component but the
    attempt): per group the components' values, episodes, closed, valid, successes."""
    names = list(provenance.ORIGIN_COMPONENTS) if group_by == ["origin"] else group_by
    for name in names:
        if name not in provenance.COMPONENTS:
            raise ValidationFailed(
                "group_by is 'origin' or provenance components "
                f"({', '.join(provenance.COMPONENTS)})",
                field="group_by",
            )
    if not names:
        raise ValidationFailed("group_by needs at least one component", field="group_by")
    paths = {name: f"provenance__{name}" for name in names}
    closed = Q(status=EpisodeStatus.CLOSED)
    rows = (
        episodes.order_by()
        .values(*paths.values())
        .annotate(
            episodes=Count("pk"),
            closed=Count("pk", filter=closed),
            valid=Count("pk", filter=closed & ~Q(failure_class__in=list(INVALID_CLASSES))),
            successes=Count("pk", filter=closed & Q(failure_class=FailureClass.SUCCESS)),
        )
    )
    groups: list[dict[str, Any]] = [
        {
            "components": {name: row[path] or provenance.UNKNOWN for name, path in paths.items()},
            "episodes": int(row["episodes"]),
            "closed": int(row["closed"]),
            "valid": int(row["valid"]),
            "successes": int(row["successes"]),
        }
        for row in rows
    ]
    groups.sort(key=lambda g: (-int(g["episodes"]), [str(g["components"][n]) for n in names]))
    return groups


def episode_get(*, tenant: Tenant, episode_id: str) -> Episode:
    episode = Episode.objects.for_tenant(tenant).filter(episode_id=episode_id).first()
    if episode is None:
        raise NotFound(f"no episode {episode_id!r}", code="episode_not_found")
    return episode


@dataclass
class TaskSuccess:
    task_id: str
    rollouts: int
    valid: int
    successes: int

    @property
    def rate(self) -> float | None:
        return self.successes / self.valid if self.valid else None


@dataclass
class EpisodeStats:
    episodes: int  # closed episodes (N)
    open_episodes: int
    by_class: dict[str, int]
    valid: int
    eta: float | None  # valid / N
    cost: Decimal
    cost_per_valid: Decimal | None  # cost / (N·η)
    successes: int
    success_rate_raw: float | None  # successes / N
    success_rate_valid: float | None  # successes / valid
    tasks: int
    tasks_with_valid: int
    tasks_solved: int  # tasks with ≥ 1 successful rollout
    task_success_rate: float | None  # tasks_solved / tasks_with_valid
    mean_task_success: float | None  # mean over tasks of each task's valid success rate
    per_task: list[TaskSuccess] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "open_episodes": self.open_episodes,
            "by_class": self.by_class,
            "valid": self.valid,
            "eta": self.eta,
            "cost": str(self.cost),
            "cost_per_valid": None if self.cost_per_valid is None else str(self.cost_per_valid),
            "successes": self.successes,
            "success_rate_raw": self.success_rate_raw,
            "success_rate_valid": self.success_rate_valid,
            "tasks": self.tasks,
            "tasks_with_valid": self.tasks_with_valid,
            "tasks_solved": self.tasks_solved,
            "task_success_rate": self.task_success_rate,
            "mean_task_success": self.mean_task_success,
            "per_task": [
                {
                    "task_id": t.task_id,
                    "rollouts": t.rollouts,
                    "valid": t.valid,
                    "successes": t.successes,
                    "success_rate": t.rate,
                }
                for t in self.per_task
            ],
        }


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def episode_stats(*, episodes: QuerySet[Episode]) -> EpisodeStats:
    """The numbers over closed episodes, using each one's current (possibly relabeled)
    class. Valid = not startup/environment/verifier/observation. Cost: a final cost as
    stored (services/tally.py), any other computed now. Reads every episode of the
    set: the list page uses ``episode_numbers``."""
    return _episode_stats(episodes, live_limit=None)[0]


def _episode_stats(
    episodes: QuerySet[Episode], *, live_limit: int | None
) -> tuple[EpisodeStats, int]:
    """``episode_stats``, costing the closed episodes whose cost is not final now only
    when at most ``live_limit`` (None: always); beyond, at their stored cost. Returns
    how many were taken as stored (0 or more than ``live_limit``)."""
    open_count = episodes.filter(status=EpisodeStatus.OPEN).count()
    closed = episodes.filter(status=EpisodeStatus.CLOSED).order_by()
    by_class = {cls: 0 for cls in FailureClass.values}
    for row in closed.values("failure_class").annotate(n=Count("pk")):
        by_class[row["failure_class"] or FailureClass.UNDETERMINED] += int(row["n"])
    sums = closed.aggregate(
        final=Sum("cost", filter=Q(cost_final=True)),
        stored=Sum("cost", filter=Q(cost_final=False)),
        unsettled=Count("pk", filter=Q(cost_final=False)),
    )
    cost = sums["final"] or Decimal(0)
    as_stored = 0
    if live_limit is not None and sums["unsettled"] > live_limit:
        cost += sums["stored"] or Decimal(0)
        as_stored = int(sums["unsettled"])
    else:
        cost += episodes_total_cost(episodes=closed.filter(cost_final=False))
    invalid = list(INVALID_CLASSES)
    per_task_rows = (
        closed.values("task_id")
        .annotate(
            rollouts=Count("pk"),
            valid=Count("pk", filter=~Q(failure_class__in=invalid)),
            successes=Count("pk", filter=Q(failure_class=FailureClass.SUCCESS)),
        )
        .order_by("task_id")
    )
    per_task = [
        TaskSuccess(r["task_id"], int(r["rollouts"]), int(r["valid"]), int(r["successes"]))
        for r in per_task_rows
    ]
    return _stats(by_class, open_count, cost, per_task), as_stored


def _stats(
    by_class: dict[str, int], open_count: int, cost: Decimal, per_task: list[TaskSuccess]
) -> EpisodeStats:
    n = sum(by_class.values())
    valid = n - sum(by_class[cls] for cls in INVALID_CLASSES)
    successes = by_class[FailureClass.SUCCESS]
    cost = cost.quantize(QUANTUM)
    with_valid = [t for t in per_task if t.valid]
    solved = sum(1 for t in per_task if t.successes)
    rates = [t.rate for t in with_valid if t.rate is not None]
    return EpisodeStats(
        episodes=n,
        open_episodes=open_count,
        by_class=by_class,
        valid=valid,
        eta=_ratio(valid, n),
        cost=cost,
        cost_per_valid=(cost / valid).quantize(Decimal("0.000001")) if valid else None,
        successes=successes,
        success_rate_raw=_ratio(successes, n),
        success_rate_valid=_ratio(successes, valid),
        tasks=len(per_task),
        tasks_with_valid=len(with_valid),
        tasks_solved=solved,
        task_success_rate=_ratio(solved, len(with_valid)),
        mean_task_success=sum(rates) / len(rates) if rates else None,
        per_task=per_task,
    )


def episode_timeline(*, episode: Episode) -> list[dict[str, Any]]:
    """Steps and the lifecycle events of the episode's sandboxes, in time order.
    Events are those of the linked generations, from just before the episode started
    until it ended (or now)."""
    items: list[dict[str, Any]] = []
    # Steps keep their index order: a step without a time (or with a client clock a bit
    # behind the server's) is placed no earlier than the step before it.
    at = episode.started_at
    for step in episode.steps.all():
        at = max(at, step.started_at or at)
        items.append({"type": "step", "at": at, "step": step})
    for link in episode.sandbox_links.select_related("sandbox"):
        if link.sandbox is None:
            continue
        events = SandboxEvent.objects.filter(sandbox=link.sandbox)
        if link.generation is not None:
            events = events.filter(generation__in=(0, link.generation))
        if episode.ended_at is not None:
            events = events.filter(at__lte=episode.ended_at + DETECTION_GRACE)
        for event in events:
            items.append(
                {"type": "event", "at": event.at, "event": event, "sandbox_id": link.sandbox_ref}
            )
    items.sort(
        key=lambda item: (
            item["at"],
            0 if item["type"] == "event" else 1,
            item["step"].index if item["type"] == "step" else 0,
        )
    )
    return items


def episode_relabels(*, episode: Episode) -> QuerySet[Any]:
    return episode.relabels.all()


def episode_reattributions(*, episode: Episode) -> QuerySet[Any]:
    """The control plane's later changes of the episode's class (tenant-scoped by it)."""
    return episode.reattributions.filter(tenant_id=episode.tenant_id)


def episode_compare(*, a: Episode, b: Episode) -> list[tuple[Step | None, Step | None]]:
    """Steps of two episodes of the same task paired by index (409 for different tasks)."""
    if a.task_id != b.task_id:
        raise Conflict(
            f"episodes are of different tasks ({a.task_id} vs {b.task_id})",
            code="different_tasks",
        )
    return list(zip_longest(a.steps.all(), b.steps.all()))


def task_ids(*, tenant: Tenant) -> list[str]:
    """The tenant's tasks (from the tally: one row per task, status and class)."""
    return sorted({row.task_id for row in episode_tally(tenant=tenant)})


# -- the numbers at size (issue 20): kept counts, or a bounded scan ------------------

# Filters the tally is keyed by: the numbers under only these come from it, exactly.
TALLY_FILTERS = {"task": "task_id", "status": "status", "failure_class": "failure_class"}
# Any other filter or a search reads the matching episodes, the newest this many at most.
STATS_SCAN_LIMIT = 5000
# Closed episodes whose cost is not final (a sandbox still running) are costed now when
# at most this many; beyond, at their cost as stored at their last attribution (said).
STATS_LIVE_LIMIT = 200

TALLY_SQL = """
SELECT task_id, status, failure_class, sum(episodes), sum(final_episodes), sum(final_cost),
       sum(stored_cost)
FROM (
  SELECT task_id, status, failure_class, episodes, final_episodes, final_cost, stored_cost
  FROM trajectories_episodetally WHERE tenant_id = %(tenant)s{where}
  UNION ALL
  SELECT task_id, status, failure_class, episodes, final_episodes, final_cost, stored_cost
  FROM trajectories_episodetallydelta WHERE tenant_id = %(tenant)s{where}
) AS t
GROUP BY 1, 2, 3 HAVING sum(episodes) <> 0
"""


@dataclass(frozen=True)
class TallyRow:
    task_id: str
    status: str
    failure_class: str
    episodes: int
    final_episodes: int
    final_cost: Decimal
    stored_cost: Decimal


def episode_tally(*, tenant: Tenant, filters: dict[str, str] | None = None) -> list[TallyRow]:
    """The kept counts per (task, status, class) of the tenant, the folded tally plus
    the deltas not folded yet; ``filters`` only those of ``TALLY_FILTERS`` (comma = any
    of). One statement: its cost is the number of keys and of recent changes."""
    params: dict[str, Any] = {"tenant": tenant.pk}
    where = ""
    for param, column in TALLY_FILTERS.items():
        value = (filters or {}).get(param, "")
        if value:
            params[param] = value.split(",")
            where += f" AND {column} = ANY(%({param})s)"
    with connection.cursor() as cursor:
        # Identifiers only from TALLY_FILTERS; values are parameters.
        cursor.execute(TALLY_SQL.format(where=where), params)
        rows = cursor.fetchall()
    return [
        TallyRow(task, status, cls, int(n), int(final_n), Decimal(final_cost), Decimal(stored))
        for task, status, cls, n, final_n, final_cost, stored in rows
    ]


@dataclass(frozen=True)
class EpisodeNumbers:
    stats: EpisodeStats
    # None: exact over every matching episode. Otherwise the numbers are over the
    # newest ``scanned`` of more matching episodes (a filter the tally does not keep).
    scanned: int | None = None
    # How many closed episodes' cost is as stored at their last attribution rather than
    # computed now (their sandboxes still run): 0 = every cost is final or computed now.
    cost_as_stored: int = 0


def episode_stats_kept(
    *,
    tenant: Tenant,
    filters: dict[str, str] | None = None,
    exact: bool = False,
) -> tuple[EpisodeStats, int]:
    """``episode_stats`` of ``episode_list(tenant, filters)`` for filters the tally keeps,
    from the tally, and how many closed episodes' cost is as stored (see
    ``EpisodeNumbers``). Final costs as kept; the closed episodes whose cost is not final
    yet (a live sandbox) computed now when at most ``STATS_LIVE_LIMIT`` or ``exact`` (as
    the API's figures need), found through a partial index, else at their stored cost."""
    rows = episode_tally(tenant=tenant, filters=filters)
    by_class = {cls: 0 for cls in FailureClass.values}
    tasks: dict[str, TaskSuccess] = {}
    open_count = 0
    cost = Decimal(0)
    unsettled = 0
    unsettled_stored = Decimal(0)
    for row in rows:
        if row.status == EpisodeStatus.OPEN:
            open_count += row.episodes
            continue
        if row.status != EpisodeStatus.CLOSED:
            continue
        cls = row.failure_class or FailureClass.UNDETERMINED
        by_class[cls] += row.episodes
        task = tasks.setdefault(row.task_id, TaskSuccess(row.task_id, 0, 0, 0))
        task.rollouts += row.episodes
        if row.failure_class not in INVALID_CLASSES:
            task.valid += row.episodes
        if row.failure_class == FailureClass.SUCCESS:
            task.successes += row.episodes
        cost += row.final_cost
        unsettled += row.episodes - row.final_episodes
        unsettled_stored += row.stored_cost - row.final_cost
    as_stored = unsettled if not exact and unsettled > STATS_LIVE_LIMIT else 0
    if as_stored:
        cost += unsettled_stored
    elif unsettled:
        pending = Episode.objects.for_tenant(tenant).filter(
            status=EpisodeStatus.CLOSED, cost_final=False
        )
        for param, column in TALLY_FILTERS.items():
            value = (filters or {}).get(param, "")
            if value:
                pending = pending.filter(**{f"{column}__in": value.split(",")})
        cost += episodes_total_cost(episodes=pending)
    per_task = [tasks[t] for t in sorted(tasks)]
    return _stats(by_class, open_count, cost, per_task), as_stored


def episode_stats_exact(*, tenant: Tenant, filters: dict[str, str] | None = None) -> EpisodeStats:
    """The API's ``episode_stats`` of ``episode_list(tenant, filters)``, exact: from the
    tally when every filter is one it keeps (its cost follows the keys and the episodes
    whose cost is not final yet, not the history), else over every matching episode."""
    active = {k: v for k, v in (filters or {}).items() if v}
    if set(active) <= set(TALLY_FILTERS):
        return episode_stats_kept(tenant=tenant, filters=active, exact=True)[0]
    return episode_stats(episodes=episode_list(tenant=tenant, filters=active))


def episode_numbers(
    *, tenant: Tenant, filters: dict[str, str] | None = None, search: str = ""
) -> EpisodeNumbers:
    """The list page's numbers. Under no filter, or only those the tally keeps, from
    the tally (exact, whatever the history's size). Under any other filter or a search,
    over the matching episodes, read through ``episode_list``'s order: exact when at
    most ``STATS_SCAN_LIMIT`` match, else over the newest that many (``scanned``)."""
    active = {k: v for k, v in (filters or {}).items() if v}
    if not search.strip() and set(active) <= set(TALLY_FILTERS):
        stats, as_stored = episode_stats_kept(tenant=tenant, filters=active)
        return EpisodeNumbers(stats, cost_as_stored=as_stored)
    matching = episode_search(episode_list(tenant=tenant, filters=active), search).order_by(
        "-started_at", "-id"
    )
    more = matching[STATS_SCAN_LIMIT : STATS_SCAN_LIMIT + 1].exists()
    scanned = STATS_SCAN_LIMIT if more else None
    # the newest matches as a subquery: Postgres bounds it, no id list goes round trip
    chosen = Episode.objects.filter(pk__in=matching.values("pk")[:STATS_SCAN_LIMIT])
    stats, as_stored = _episode_stats(chosen, live_limit=STATS_LIVE_LIMIT)
    return EpisodeNumbers(stats, scanned, as_stored)
