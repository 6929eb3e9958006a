"""What an episode costs: the full cost of the sandboxes it used, apportioned when
several episodes used one, plus what the client reports (model tokens…).

A sandbox's cost is the billing area's priced usage record over its whole life
(startup fee, the time before the episode opened, idle time after), because that is
what the team pays for the sample. When N episodes link one sandbox, each carries 1/N
of it (docs/trajectories.md "Cost"). A live sandbox's cost still accrues: the numbers
(``episodes_total_cost``) compute it when asked; an episode's stored ``cost`` is as of
its last attribution (close, ``/attribute``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db.models import Count, QuerySet

from apps.billing.usage import cost_for_sandboxes
from apps.sandboxes.models import Sandbox
from apps.trajectories.models import Episode, EpisodeSandbox

QUANTUM = Decimal("0.000001")


def episode_sandbox_cost(*, episode: Episode) -> tuple[Decimal, list[dict[str, Any]]]:
    """(cost, basis): the episode's share of each linked sandbox's full cost. Two
    queries plus one for the sharing counts."""
    sandbox_pks = sorted(
        {
            pk
            for pk in episode.sandbox_links.filter(sandbox__isnull=False).values_list(
                "sandbox_id", flat=True
            )
            if pk is not None
        },
        key=str,
    )
    if not sandbox_pks:
        return Decimal(0), []
    full = cost_for_sandboxes(sandbox_ids=sandbox_pks)
    sharing = {
        row["sandbox_id"]: int(row["n"])
        for row in EpisodeSandbox.objects.filter(sandbox_id__in=sandbox_pks)
        .values("sandbox_id")
        .annotate(n=Count("episode", distinct=True))
    }
    refs = dict(Sandbox.objects.filter(pk__in=sandbox_pks).values_list("pk", "external_id"))
    total = Decimal(0)
    basis = []
    for pk in sandbox_pks:
        cost = full[str(pk)]
        episodes = max(sharing.get(pk, 1), 1)
        share = cost / episodes
        total += share
        basis.append(
            {
                "sandbox_id": refs.get(pk, ""),
                "sandbox_cost": str(cost.quantize(QUANTUM)),
                "episodes": episodes,
                "share": str(share.quantize(QUANTUM)),
            }
        )
    return total.quantize(QUANTUM), basis


def sharing_episodes(*, sandbox_pks: list[Any]) -> list[Episode]:
    """Closed, locally recorded episodes that used any of these sandboxes."""
    return list(
        Episode.objects.filter(
            sandbox_links__sandbox_id__in=sandbox_pks, status="closed", imported=False
        ).distinct()
    )


def episodes_total_cost(*, episodes: QuerySet[Episode]) -> Decimal:
    """What a set of episodes cost, computed now: each locally recorded episode's share
    of its sandboxes' full cost (live sandboxes accrued to now, ended ones final) plus
    its client cost; an episode without sandboxes here (imported, or none linked) at
    its stored cost. Four queries whatever the set's size."""
    links = set(
        EpisodeSandbox.objects.filter(
            episode__in=episodes, episode__imported=False, sandbox__isnull=False
        ).values_list("episode_id", "sandbox_id")
    )
    linked = {episode for episode, _ in links}
    sandbox_pks = sorted({sandbox for _, sandbox in links}, key=str)
    total = Decimal(0)
    if sandbox_pks:
        full = cost_for_sandboxes(sandbox_ids=sandbox_pks)
        sharing = {
            row["sandbox_id"]: int(row["n"])
            for row in EpisodeSandbox.objects.filter(sandbox_id__in=sandbox_pks)
            .values("sandbox_id")
            .annotate(n=Count("episode", distinct=True))
        }
        for _, sandbox in links:
            total += full[str(sandbox)] / max(sharing.get(sandbox, 1), 1)
    rows = episodes.order_by().values_list("pk", "cost", "client_cost")
    for pk, cost, client_cost in rows:
        total += client_cost if pk in linked else cost
    return total.quantize(QUANTUM)
