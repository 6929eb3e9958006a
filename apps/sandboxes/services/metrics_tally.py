"""Tallies ``/metrics`` reports without reading every row each scrape (issue 20,
docs/operations.md "Background costs").

Sandboxes by state and tenant, the create-to-ready and exec histograms and failed
operations by code are counts over tables that grow with history and with the live
fleet. Postgres triggers (migration ``0015_metrics_tallies``) append a delta row to
``MetricsDelta`` for every change to what they count, in the writer's transaction:
an insert (+1), a delete (-1), an update that moves a row between keys (-1 old, +1
new). Retention's summaries carry their share too, so a row summarized and deleted
leaves the counts as they were.

``tallies()`` moves every committed delta into one ``MetricsFold`` row (``tallies``)
and returns the sums: what it reads is the deltas written since the last call (the
rate of change), plus one row. One caller folds at a time (the fold row's lock); the
``DELETE … RETURNING`` takes only committed deltas, and a delta committed after it is
taken by the next call, so nothing is counted twice or lost. Beat runs it every
minute (``fold-metrics``) so the deltas stay few when nobody scrapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from django.db import connection, transaction
from django.utils import timezone

from apps.sandboxes.models import MetricsFold

NAME = "tallies"


@dataclass
class Tally:
    """One tally's keys: count and total (seconds, for histograms)."""

    counts: dict[str, int] = field(default_factory=dict)
    totals: dict[str, Decimal] = field(default_factory=dict)

    def total(self) -> Decimal:
        return sum(self.totals.values(), Decimal(0))


def tallies() -> dict[str, Tally]:
    """Every tally by name (``sandboxes``: ``state|tenant_id``; ``ready``/``exec``: the
    1-based bucket index, ``len + 1`` above every bound; ``errors``: the code)."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO sandboxes_metricsfold (name, through, counts) "
                "VALUES (%s, %s, '{}') ON CONFLICT (name) DO NOTHING",
                [NAME, timezone.now()],
            )
        fold = MetricsFold.objects.select_for_update().get(name=NAME)
        with connection.cursor() as cursor:
            cursor.execute(
                "WITH d AS (DELETE FROM sandboxes_metricsdelta RETURNING name, key, n, total) "
                "SELECT name, key, sum(n), sum(total) FROM d GROUP BY name, key"
            )
            moved = cursor.fetchall()
        if moved:
            counts: dict[str, list[int | str]] = dict(fold.counts)
            for name, key, n, total in moved:
                slot = f"{name}|{key}"
                was_n, was_total = counts.get(slot, [0, "0"])
                now_n, now_total = int(was_n) + int(n), Decimal(str(was_total)) + total
                if now_n == 0 and now_total == 0:
                    counts.pop(slot, None)  # a key that came and went (a tenant's state)
                else:
                    counts[slot] = [now_n, str(now_total)]
            fold.counts = counts
            fold.through = timezone.now()
            fold.save(update_fields=["counts", "through"])
    out: dict[str, Tally] = {}
    for slot, (n, total) in fold.counts.items():
        name, key = slot.split("|", 1)
        tally = out.setdefault(name, Tally())
        tally.counts[key] = int(n)
        tally.totals[key] = Decimal(str(total))
    return out
