"""Counters over an append-only history without reading the history every scrape
(issue 20, docs/operations.md "Background costs").

A counter such as "automatic lifecycle actions by reason" is a ``GROUP BY`` over every
ledger row ever written. The fold keeps that sum for the rows stamped before a point
in time (``MetricsFold.through``); a scrape counts only the rows stamped since (through
an index on the stamp) and adds the fold. When the fold is older than ``LAG``, the
scrape first moves it up to ``now - LAG``, adding the rows in between.

Why a lag: a row is stamped (``timezone.now()`` in Python) a moment before its
transaction commits, so the newest stamps may still be invisible. Only rows stamped
more than ``LAG`` ago are folded; they are committed long since (the writers of these
tables hold no transaction near that long: a ledger row commits with its one-statement
transition, a reconciler round within its task's 180 s limit). Rows in the last
``LAG`` are always counted from the table itself.

Only for tables whose rows are never deleted and whose stamp and counted columns never
change after commit (``SandboxEvent``; ``ReconcileRun``'s ``started_at`` and, once the
round has ended, ``skipped``). One scraper folds at a time (``SKIP LOCKED``): another
reads the committed fold and its ``through``, which always agree.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.sandboxes.models import MetricsFold

LAG = timedelta(minutes=5)
EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

# counts(lo, hi): the rows stamped in [lo, hi) (hi None: no upper bound), by key
Counter = Callable[[datetime, datetime | None], dict[str, int]]


def _add(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    out = dict(into)
    for key, n in more.items():
        out[key] = out.get(key, 0) + n
    return out


def folded_counts(name: str, count: Counter, *, now: datetime | None = None) -> dict[str, int]:
    """Every row's count by key: the fold (moved up first when it is due) plus the rows
    stamped since its ``through``."""
    cutoff = (now or timezone.now()) - LAG
    fold: MetricsFold | None = None
    with transaction.atomic():
        fold = MetricsFold.objects.select_for_update(skip_locked=True).filter(name=name).first()
        if fold is not None and fold.through < cutoff:
            fold.counts = _add(fold.counts, count(fold.through, cutoff))
            fold.through = cutoff
            fold.save(update_fields=["counts", "through"])
    if fold is None:
        fold = MetricsFold.objects.filter(name=name).first()  # locked by another scraper
    if fold is None:  # the first scrape: fold the history once
        try:
            with transaction.atomic():
                fold = MetricsFold.objects.create(
                    name=name, through=cutoff, counts=count(EPOCH, cutoff)
                )
        except IntegrityError:  # another scraper made it first
            fold = MetricsFold.objects.get(name=name)
    return _add(fold.counts, count(fold.through, None))
