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

The fold row holds counts no single row carries any more (deleted rows' -1s are in it):
should it be lost (deleted by hand) or a counted table be ``TRUNCATE``d (no row trigger
fires), ``tallies_rebuild()`` recounts every row once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from apps.sandboxes.models import MetricsDelta, MetricsFold

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


def _recount_sql() -> list[tuple[str, list[Any]]]:
    """The migration's backfill: every counted row, as deltas (the buckets by the
    metrics' bounds, which a test keeps equal to the triggers')."""
    from apps.sandboxes.metrics import READY_BUCKETS
    from apps.sandboxes.models import EXEC_BUCKETS

    ready = [Decimal(repr(float(b))) for b in READY_BUCKETS]
    exec_ = [Decimal(repr(float(b))) for b in EXEC_BUCKETS]
    return [
        (
            "INSERT INTO sandboxes_metricsdelta (name, key, n, total) "
            "SELECT 'sandboxes', state || '|' || tenant_id::text, count(*), 0 "
            "FROM sandboxes_sandbox GROUP BY 2",
            [],
        ),
        (
            "INSERT INTO sandboxes_metricsdelta (name, key, n, total) "
            "SELECT 'ready', b, count(*), sum(d) FROM ("
            "SELECT EXTRACT(EPOCH FROM (ready_at - created_at)) AS d, "
            "hedgerow_bucket(EXTRACT(EPOCH FROM (ready_at - created_at)), %s::numeric[]) AS b "
            "FROM sandboxes_sandbox WHERE ready_at IS NOT NULL) AS t GROUP BY b",
            [ready],
        ),
        (
            "INSERT INTO sandboxes_metricsdelta (name, key, n, total) "
            "SELECT 'exec', b, count(*), sum(d) FROM ("
            "SELECT EXTRACT(EPOCH FROM (finished_at - created_at)) AS d, "
            "hedgerow_bucket(EXTRACT(EPOCH FROM (finished_at - created_at)), %s::numeric[]) "
            "AS b FROM sandboxes_operation WHERE finished_at IS NOT NULL) AS t GROUP BY b",
            [exec_],
        ),
        (
            "INSERT INTO sandboxes_metricsdelta (name, key, n, total) "
            "SELECT 'errors', coalesce(error->>'code', 'unknown'), count(*), 0 "
            "FROM sandboxes_operation WHERE status = 'failed' GROUP BY 2",
            [],
        ),
        (
            "SELECT hedgerow_summary_apply(status, error_code, count, finished, duration_s, "
            "buckets, 1) FROM sandboxes_operationsummary",
            [],
        ),
    ]


def tallies_rebuild() -> dict[str, Tally]:
    """Recounts every tally from the rows (an operator's repair: ``manage.py shell -c
    "from apps.sandboxes.services.metrics_tally import tallies_rebuild;
    tallies_rebuild()"``). Writers of the counted tables wait for it (``SHARE`` lock):
    it reads every sandbox and operation once."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "LOCK TABLE sandboxes_sandbox, sandboxes_operation, sandboxes_operationsummary "
                "IN SHARE MODE"
            )
            MetricsFold.objects.filter(name=NAME).delete()
            MetricsDelta.objects.all().delete()
            for statement, params in _recount_sql():
                cursor.execute(statement, params)
    return tallies()
