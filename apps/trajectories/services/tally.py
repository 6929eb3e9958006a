"""The list page's numbers kept as episodes change, not recounted per view (issue 20,
docs/trajectories.md "Numbers at size").

Counts: a trigger on the episode table (migration ``0010_episode_tally``) appends a
delta row per change to what the numbers count (tenant, task, status, class, and
whether the cost is final and what it is). ``episode_tally_fold`` moves the committed
deltas into ``EpisodeTally``; readers add the deltas not folded yet
(``selectors.episode_tally``), so a read costs the number of keys plus the changes
since the last fold, never the number of episodes.

Cost: an episode's cost is final once it is closed and every sandbox it used has
ended with its usage record closed (an ended sandbox no longer accrues, and no episode
can attach to it, so its share no longer changes), or it has no sandbox here (imported,
or none linked: its stored cost is what the numbers always used). ``episodes_settle_costs``
stores that final cost once and marks it (``cost_final``); the numbers take final
costs from the tally and compute only the others when asked (those with a live
sandbox, and any the sweep has not reached yet) when they are few
(``selectors.STATS_LIVE_LIMIT``); when more, their cost as stored at their last
attribution, and the page says so. A person's later relabel or a re-attribution moves
the episode between classes through the same trigger.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q

from apps.billing.models import UsageRecord
from apps.sandboxes.models import FINAL_STATES
from apps.trajectories.cost import episode_sandbox_cost
from apps.trajectories.models import Episode, EpisodeSandbox, EpisodeStatus

FOLD_SQL = """
WITH moved AS (
  DELETE FROM trajectories_episodetallydelta
  RETURNING tenant_id, task_id, status, failure_class, episodes, final_episodes, final_cost,
            stored_cost
), sums AS (
  SELECT tenant_id, task_id, status, failure_class, sum(episodes) AS episodes,
         sum(final_episodes) AS final_episodes, sum(final_cost) AS final_cost,
         sum(stored_cost) AS stored_cost
  FROM moved GROUP BY 1, 2, 3, 4
)
INSERT INTO trajectories_episodetally AS t
  (tenant_id, task_id, status, failure_class, episodes, final_episodes, final_cost, stored_cost)
  SELECT tenant_id, task_id, status, failure_class, episodes, final_episodes, final_cost,
         stored_cost
  FROM sums
ON CONFLICT (tenant_id, task_id, status, failure_class) DO UPDATE SET
  episodes = t.episodes + EXCLUDED.episodes,
  final_episodes = t.final_episodes + EXCLUDED.final_episodes,
  final_cost = t.final_cost + EXCLUDED.final_cost,
  stored_cost = t.stored_cost + EXCLUDED.stored_cost
"""


def episode_tally_fold() -> int:
    """Moves every committed delta into the tally (one statement: a delta committed
    after it started is taken by the next fold, none twice) and drops keys left at
    zero episodes. Returns the deltas folded."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(FOLD_SQL)
        folded = int(cursor.rowcount)
        cursor.execute(
            "DELETE FROM trajectories_episodetally WHERE episodes = 0 AND final_episodes = 0 "
            "AND final_cost = 0 AND stored_cost = 0"
        )
    return max(folded, 0)


def _unsettled_live_link() -> Exists:
    """A link of the episode to a sandbox that may still cost more: not ended, or its
    usage record still open."""
    open_usage = UsageRecord.objects.filter(sandbox_id=OuterRef("sandbox_id"), ended_at=None)
    return Exists(
        EpisodeSandbox.objects.filter(episode=OuterRef("pk"), sandbox__isnull=False).filter(
            ~Q(sandbox__state__in=FINAL_STATES) | Exists(open_usage)
        )
    )


def episodes_settle_costs(*, limit: int = 500) -> int:
    """Stores the final cost of up to ``limit`` closed episodes whose cost can no longer
    change, and marks it final. Each under its row lock, re-checked, so a concurrent
    re-attribution or close is not overwritten. Returns how many it settled."""
    candidates = list(
        Episode.objects.filter(status=EpisodeStatus.CLOSED, cost_final=False)
        .exclude(_unsettled_live_link())
        .order_by("ended_at", "pk")
        .values_list("pk", flat=True)[:limit]
    )
    settled = 0
    for pk in candidates:
        with transaction.atomic():
            episode = (
                Episode.objects.select_for_update()
                .filter(pk=pk, status=EpisodeStatus.CLOSED, cost_final=False)
                .exclude(_unsettled_live_link())
                .first()
            )
            if episode is None:
                continue
            fields = ["cost_final"]
            links = episode.sandbox_links.filter(sandbox__isnull=False)
            if not episode.imported and links.exists():
                sandbox_cost, episode.cost_basis = episode_sandbox_cost(episode=episode)
                episode.cost = sandbox_cost + episode.client_cost
                fields += ["cost", "cost_basis"]
            episode.cost_final = True
            episode.save(update_fields=fields)
            settled += 1
    return settled
