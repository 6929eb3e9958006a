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

from apps.core.errors import ValidationFailed
from apps.sandboxes.models import Sandbox, Snapshot, SnapshotState
from apps.trajectories.models import Episode


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


# Two-sided 95 % quantiles of Student's t by degrees of freedom (Welch's df is
# rounded down: the interval errs wide); past 30 the normal's 1.96 is within 2 %.
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
    16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
    23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
}  # fmt: skip


def _t95(df: float) -> float:
    return _T95.get(max(1, int(df)), 1.96)


def episode_counterfactual(
    *, episode: Episode, step: int, label: str, plus: str, minus: str
) -> dict[str, Any]:
    """The paired estimate for step ``t`` (docs/snapshots.md, "Counterfactuals"):
    ``Δ_t = mean R(τ⁺) − mean R(τ⁻)`` over the closed branches of ``episode`` at
    ``step``, the arm being the branch's label ``label`` (``plus`` or ``minus``), with
    Welch's 95 % interval. Continuations the ledger calls invalid (an infrastructure
    failure class) are left out and counted by class, never scored as reward 0; so are
    branches without a reward."""
    from apps.trajectories.models import INVALID_CLASSES, EpisodeStatus

    rewards: dict[str, list[float]] = {"plus": [], "minus": []}
    excluded: dict[str, int] = {}
    open_branches = 0
    for branch in episode.branches.filter(branch_step=step):
        arm_value = (branch.labels or {}).get(label)
        arm = "plus" if arm_value == plus else "minus" if arm_value == minus else None
        if arm is None:
            continue
        if branch.status != EpisodeStatus.CLOSED:
            open_branches += 1
        elif branch.failure_class in INVALID_CLASSES:
            excluded[branch.failure_class] = excluded.get(branch.failure_class, 0) + 1
        elif branch.reward is None:
            excluded["no_reward"] = excluded.get("no_reward", 0) + 1
        else:
            rewards[arm].append(float(branch.reward))
    answer: dict[str, Any] = {
        "step": step,
        "arms": {"label": label, "plus": plus, "minus": minus},
        "n_plus": len(rewards["plus"]),
        "n_minus": len(rewards["minus"]),
        "mean_plus": _mean(rewards["plus"]),
        "mean_minus": _mean(rewards["minus"]),
        "excluded": excluded,
        "open": open_branches,
        "delta": None,
        "ci95": None,
    }
    if answer["mean_plus"] is None or answer["mean_minus"] is None:
        return answer
    answer["delta"] = answer["mean_plus"] - answer["mean_minus"]
    n1, n2 = len(rewards["plus"]), len(rewards["minus"])
    if n1 < 2 or n2 < 2:
        return answer  # no variance estimate: no interval
    v1, v2 = statistics.variance(rewards["plus"]) / n1, statistics.variance(rewards["minus"]) / n2
    se = (v1 + v2) ** 0.5
    if se == 0:
        answer["ci95"] = [answer["delta"], answer["delta"]]
        return answer
    df = (v1 + v2) ** 2 / (v1**2 / (n1 - 1) + v2**2 / (n2 - 1))
    half = _t95(df) * se
    answer["ci95"] = [answer["delta"] - half, answer["delta"] + half]
    answer["df"] = df
    return answer


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None
