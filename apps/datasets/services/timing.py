"""Where an episode's time goes (docs/datasets.md "Where the time goes"): model calls,
the environment (execs, tools, file transfers), the verifier — from the step records —
and waiting for a sandbox (admission queue, start-up) from the lifecycle ledger.

* ``model_s``: each step's ``model_call.latency_s`` (a ``model`` step without one: its
  ``duration_s``);
* ``environment_s``: ``duration_s`` of ``exec`` and ``tool`` steps (else the operation's
  ``usage.wall_s``);
* ``verifier_s``: ``duration_s`` of ``verifier`` steps;
* ``other_s``: the episode's wall time minus those three (harness, prompt building,
  idle), never below zero;
* ``queue_s`` / ``startup_s``: per linked sandbox generation, ``queued → requested`` and
  ``requested → ready`` in the ledger. These usually happen before the episode opens
  (create, then open the episode) so they are reported beside the wall time, not in it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from django.db.models import QuerySet

from apps.sandboxes.models import SandboxEvent
from apps.trajectories.models import Episode, EpisodeSandbox, EpisodeStatus, Step

PARTS = ("model_s", "environment_s", "verifier_s", "other_s")
AGGREGATE_LIMIT = 500


def _num(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) and value > 0 else 0.0


def _step_parts(kind: str, duration: Any, model_call: Any, observation: Any) -> dict[str, float]:
    parts = {"model_s": 0.0, "environment_s": 0.0, "verifier_s": 0.0}
    latency = _num(model_call.get("latency_s")) if isinstance(model_call, dict) else 0.0
    parts["model_s"] += latency
    took = _num(duration)
    if not took and isinstance(observation, dict) and isinstance(observation.get("usage"), dict):
        took = _num(observation["usage"].get("wall_s"))
    if kind == "model" and not latency:
        parts["model_s"] += took
    elif kind in ("exec", "tool"):
        parts["environment_s"] += took
    elif kind == "verifier":
        parts["verifier_s"] += took
    return parts


def _ledger_waits(links: list[tuple[Any, int | None]]) -> dict[Any, tuple[float, float]]:
    """Per (sandbox pk, generation): (queue seconds, start-up seconds)."""
    pks = {pk for pk, _ in links if pk is not None}
    events: dict[Any, list[tuple[Any, str, int]]] = defaultdict(list)
    for sandbox_id, at, to_state, generation in (
        SandboxEvent.objects.filter(
            sandbox_id__in=pks, to_state__in=("queued", "requested", "ready")
        )
        .order_by("at", "id")
        .values_list("sandbox_id", "at", "to_state", "generation")
    ):
        events[sandbox_id].append((at, to_state, generation))
    out: dict[Any, tuple[float, float]] = {}
    for pk, gen in links:
        if pk is None:
            continue
        first: dict[str, Any] = {}
        for at, state, generation in events.get(pk, []):
            if gen is not None and generation not in (0, gen):
                continue
            first.setdefault(state, at)
        queue = startup = 0.0
        if "queued" in first and "requested" in first:
            queue = max(0.0, (first["requested"] - first["queued"]).total_seconds())
        if "requested" in first and "ready" in first:
            startup = max(0.0, (first["ready"] - first["requested"]).total_seconds())
        out[(pk, gen)] = (queue, startup)
    return out


def _breakdowns(episodes: list[Episode]) -> dict[Any, dict[str, Any]]:
    ids = [e.pk for e in episodes]
    totals: dict[Any, dict[str, float]] = {
        pk: {"model_s": 0.0, "environment_s": 0.0, "verifier_s": 0.0} for pk in ids
    }
    for episode_id, kind, duration, model_call, observation in Step.objects.filter(
        episode_id__in=ids
    ).values_list("episode_id", "kind", "duration_s", "model_call", "observation"):
        for name, value in _step_parts(kind, duration, model_call, observation).items():
            totals[episode_id][name] += value
    links: dict[Any, list[tuple[Any, int | None]]] = defaultdict(list)
    for episode_id, sandbox_id, generation in EpisodeSandbox.objects.filter(
        episode_id__in=ids
    ).values_list("episode_id", "sandbox_id", "generation"):
        links[episode_id].append((sandbox_id, generation))
    waits = _ledger_waits([link for group in links.values() for link in group])
    out: dict[Any, dict[str, Any]] = {}
    for e in episodes:
        parts = totals[e.pk]
        wall = (e.ended_at - e.started_at).total_seconds() if e.ended_at else None
        busy = sum(parts.values())
        queue = sum(waits.get(link, (0.0, 0.0))[0] for link in links[e.pk])
        startup = sum(waits.get(link, (0.0, 0.0))[1] for link in links[e.pk])
        out[e.pk] = {
            "wall_s": wall,
            **{k: round(v, 6) for k, v in parts.items()},
            "other_s": None if wall is None else round(max(0.0, wall - busy), 6),
            "queue_s": round(queue, 6),
            "startup_s": round(startup, 6),
        }
    return out


def episode_time(episode: Episode) -> dict[str, Any]:
    return {"episode_id": episode.episode_id, **_breakdowns([episode])[episode.pk]}


def episodes_time(episodes: QuerySet[Episode], limit: int = AGGREGATE_LIMIT) -> dict[str, Any]:
    """Sums and shares over the most recent ``limit`` closed episodes of the query."""
    # only what the breakdown reads: the list page shows this under every view, and the
    # whole rows (labels, evidence, provenance…) of 500 episodes were most of its cost
    chosen = list(
        episodes.filter(status=EpisodeStatus.CLOSED)
        .select_related(None)
        .only("pk", "started_at", "ended_at")
        .order_by("-started_at", "-created_at")[:limit]
    )
    rows = _breakdowns(chosen).values()
    keys = ("wall_s", *PARTS, "queue_s", "startup_s")
    sums = {k: round(sum((r[k] or 0.0) for r in rows), 6) for k in keys}
    spent = sum(sums[k] for k in PARTS)
    return {
        "episodes": len(chosen),
        "limit": limit,
        "total": sums,
        "share": {k: (sums[k] / spent if spent else None) for k in PARTS},
        "per_episode": {k: (sums[k] / len(chosen) if chosen else None) for k in keys},
    }
