"""Branch advice: is snapshot-and-fork cheaper than replaying the prefix?

The seeds' rule (docs/snapshots.md, "When to branch"): K continuations from the state
after step ``t`` cost ``C_s + K·C_r`` with a snapshot (capture once, restore K times)
and ``K·C_p`` by replay (each continuation re-runs the prefix). ``C_p`` is the sum of
the recorded durations of the episode's steps up to ``t``; ``C_s`` and ``C_r`` are
measured on this installation: the captures of the episode's own sandboxes and the
restores made from them (or, before any restore, their own create time: a restore
costs what a create costs, docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
from typing import Any

from apps.sandboxes.models import Sandbox, Snapshot, SnapshotState
from apps.trajectories.models import Episode
from controlplane.errors import ValidationFailed


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _seconds(sandboxes: list[Sandbox]) -> list[float]:
    return [
        (s.ready_at - s.provisioning_started_at).total_seconds()
        for s in sandboxes
        if s.ready_at is not None and s.provisioning_started_at is not None
    ]


def episode_branch_advice(*, episode: Episode, k: int, step: int | None = None) -> dict[str, Any]:
    """Costs in seconds of wall time and the advice (``branch``, ``replay`` or
    ``unknown`` when this episode's sandboxes were never captured)."""
    if not 1 <= k <= 10_000:
        raise ValidationFailed("k: 1 ≤ K ≤ 10000", field="k")
    steps = episode.steps.all()
    if step is not None:
        steps = steps.filter(index__lte=step)
    durations = list(steps.values_list("duration_s", flat=True))
    c_p = float(sum(d for d in durations if d is not None))
    sandbox_ids = [sid for sid in episode.sandbox_links.values_list("sandbox_id", flat=True) if sid]
    snapshots = Snapshot.objects.filter(
        sandbox_id__in=sandbox_ids,
        state__in=(SnapshotState.READY, SnapshotState.DELETED),
        capture_wall_s__isnull=False,
    )
    c_s = _median([s.capture_wall_s for s in snapshots if s.capture_wall_s is not None])
    restores = _seconds(list(Sandbox.objects.filter(snapshot__in=snapshots)))
    c_r, c_r_source = _median(restores), "restores"
    if c_r is None:
        c_r, c_r_source = (
            _median(_seconds(list(Sandbox.objects.filter(pk__in=sandbox_ids)))),
            ("creates"),
        )
    basis = {
        "steps": len(durations),
        "steps_without_duration": sum(d is None for d in durations),
        "captures": len(snapshots),
        "restores": len(restores),
        "c_r_from": c_r_source if c_r is not None else None,
    }
    answer: dict[str, Any] = {
        "k": k,
        "step": step,
        "c_p": c_p,
        "c_s": c_s,
        "c_r": c_r,
        "basis": basis,
    }
    if c_s is None or c_r is None:
        answer.update(
            snapshot_cost=None,
            replay_cost=k * c_p,
            advice="unknown",
            reason="no capture of this episode's sandboxes has been measured yet",
        )
        return answer
    snapshot_cost, replay_cost = c_s + k * c_r, k * c_p
    answer.update(
        snapshot_cost=snapshot_cost,
        replay_cost=replay_cost,
        advice="branch" if snapshot_cost < replay_cost else "replay",
        reason=f"C_s + K·C_r = {snapshot_cost:.3f} s "
        f"{'<' if snapshot_cost < replay_cost else '≥'} K·C_p = {replay_cost:.3f} s",
    )
    return answer
