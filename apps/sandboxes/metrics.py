"""Prometheus metrics, computed from the database and Redis at scrape time.

Why not in-process counters: the facts happen in many processes (web workers, Celery
workers, the watcher) that start and die independently; the ledger and operation rows
already record every one of them. Reading them at scrape time makes every web process
report the same, complete numbers, with no multiprocess bookkeeping. Each scrape is a
handful of aggregate queries; the counters over the append-only ledger and the
reconciler's rounds read only the rows since their fold (``services/metrics_fold.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.db.models import Count
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from apps.core.redis_sync import redis_client
from apps.sandboxes.models import (
    EXEC_BUCKETS,
    AuditRun,
    ReconcileRun,
    Sandbox,
    SandboxEvent,
    State,
)
from apps.sandboxes.services.audit import TERMS
from apps.sandboxes.services.metrics_fold import folded_counts
from apps.sandboxes.services.retention import operation_summary_totals
from apps.sandboxes.services.warm_pool import warm_pool_stats, warm_pool_targets

log = logging.getLogger(__name__)

READY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
AUTOMATIC_ACTORS = ("reaper", "reconciler", "watcher", "system")


def _histogram_sql(table: str, start: str, end: str, buckets: Iterable[float]) -> str:
    # Cumulative buckets in one pass: count(*) FILTER (WHERE duration <= le) per bucket.
    duration = f"EXTRACT(EPOCH FROM ({end} - {start}))"
    parts = [f"count(*) FILTER (WHERE {duration} <= {float(le)!r})" for le in buckets]
    parts += ["count(*)", f"coalesce(sum({duration}), 0)"]
    return f"SELECT {', '.join(parts)} FROM {table} WHERE {end} IS NOT NULL"  # noqa: S608


def _histogram(
    name: str,
    doc: str,
    table: str,
    start: str,
    end: str,
    buckets: tuple[float, ...],
    summarized: dict[str, Any] | None = None,
) -> HistogramMetricFamily:
    """``summarized``: what retention folded into summaries (its rows are gone), added
    so the histogram never goes down."""
    with connection.cursor() as cursor:
        cursor.execute(_histogram_sql(table, start, end, buckets))
        row = cursor.fetchone()
    counts, total, total_sum = list(row[: len(buckets)]), row[-2], row[-1]
    if summarized is not None:
        counts = [a + b for a, b in zip(counts, summarized["buckets"], strict=True)]
        total += summarized["finished"]
        total_sum = float(total_sum) + summarized["duration_s"]
    metric = HistogramMetricFamily(name, doc)
    metric.add_metric(
        [],
        [(repr(le), float(c)) for le, c in zip(buckets, counts, strict=True)]
        + [("+Inf", float(total))],
        float(total_sum),
    )
    return metric


def _action_counts(lo: datetime, hi: datetime | None) -> dict[str, int]:
    """Automatic ledger rows stamped in [lo, hi), by ``actor|event|reason`` (the
    ``at`` index bounds the read)."""
    rows = SandboxEvent.objects.filter(actor__in=AUTOMATIC_ACTORS, at__gte=lo).exclude(reason="")
    if hi is not None:
        rows = rows.filter(at__lt=hi)
    return {
        f"{actor}|{event}|{reason}": n
        for actor, event, reason, n in rows.values_list("actor", "event", "reason")
        .annotate(n=Count("id"))
        .order_by()
    }


def _reconcile_counts(lo: datetime, hi: datetime | None) -> dict[str, int]:
    """Reconciler rounds started in [lo, hi), by outcome."""
    rows = ReconcileRun.objects.filter(started_at__gte=lo)
    if hi is not None:
        rows = rows.filter(started_at__lt=hi)
    return {
        "skipped" if skipped else "completed": n
        for skipped, n in rows.values_list("skipped").annotate(n=Count("id")).order_by()
    }


class HedgerowCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        summarized = operation_summary_totals()
        yield from self._sandboxes()
        yield _histogram(
            "hedgerow_sandbox_create_to_ready_seconds",
            "Time from the create request to the agent answering /health.",
            "sandboxes_sandbox",
            "created_at",
            "ready_at",
            READY_BUCKETS,
        )
        yield _histogram(
            "hedgerow_exec_duration_seconds",
            "Exec wall time as the control plane saw it (request recorded to result stored).",
            "sandboxes_operation",
            "created_at",
            "finished_at",
            EXEC_BUCKETS,
            summarized,
        )
        yield from self._actions()
        yield from self._agent_errors(summarized["errors"])
        yield from self._audit()
        yield from self._reconcile()
        yield from self._queues()
        yield from self._warm_pool()

    def _sandboxes(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily(
            "hedgerow_sandboxes", "Sandboxes by state and tenant.", labels=["state", "tenant"]
        )
        rows = Sandbox.objects.values("state", "tenant__slug").annotate(n=Count("id"))
        for row in rows.order_by("state", "tenant__slug"):
            by_state.add_metric([row["state"], row["tenant__slug"]], row["n"])
        yield by_state
        depth = GaugeMetricFamily(
            "hedgerow_admission_queue_depth",
            "Sandboxes admitted but not started: waiting for capacity (queued) or for a "
            "worker to pick them up (requested).",
            labels=["stage"],
        )
        waiting = {
            row["state"]: row["n"]
            for row in Sandbox.objects.filter(state__in=("queued", State.REQUESTED))
            .values("state")
            .annotate(n=Count("id"))
        }
        for stage in ("queued", State.REQUESTED):
            depth.add_metric([str(stage)], waiting.get(stage, 0))
        yield depth

    def _actions(self) -> Iterator[Metric]:
        actions = CounterMetricFamily(
            "hedgerow_lifecycle_actions",
            "Automatic lifecycle actions (reapers, reconciler, watcher) by reason.",
            labels=["actor", "event", "reason"],
        )
        counts = folded_counts("lifecycle_actions", _action_counts)
        for key in sorted(counts):
            actions.add_metric(key.split("|", 2), counts[key])
        yield actions

    def _agent_errors(self, summarized: dict[str, int]) -> Iterator[Metric]:
        errors = CounterMetricFamily(
            "hedgerow_agent_errors",
            "Operations that ended failed (agent unreachable, agent error, interrupted…).",
            labels=["code"],
        )
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT coalesce(error->>'code', 'unknown'), count(*) FROM sandboxes_operation "
                "WHERE status = 'failed' GROUP BY 1 ORDER BY 1"
            )
            counts = dict(summarized)
            for code, n in cursor.fetchall():
                counts[code] = counts.get(code, 0) + n
        for code in sorted(counts):
            errors.add_metric([code], counts[code])
        yield errors

    def _audit(self) -> Iterator[Metric]:
        latest = AuditRun.objects.filter(tenant=None, image="", node="", backend="").first()
        terms = GaugeMetricFamily(
            "hedgerow_audit_term",
            "Terms of the latest installation-wide leak audit "
            "(created = deleted + reaped_ttl + reaped_heartbeat + failed + lost + live + leaked).",
            labels=["term"],
        )
        balanced = GaugeMetricFamily(
            "hedgerow_audit_balanced", "1 when the latest audit balanced with nothing orphaned."
        )
        when = GaugeMetricFamily(
            "hedgerow_audit_timestamp_seconds", "When the latest audit ran (unix time)."
        )
        if latest is not None:
            for term in ("created", *TERMS, "orphaned", "reclaimed"):
                terms.add_metric([term], getattr(latest, term))
            balanced.add_metric([], 1.0 if latest.balanced else 0.0)
            when.add_metric([], latest.created_at.timestamp())
            yield GaugeMetricFamily(
                "hedgerow_audit_ttl_reap_share",
                "Share of ended sandboxes removed by the TTL reaper (a backstop).",
                value=latest.ttl_share,
            )
        yield from (terms, balanced, when)

    def _reconcile(self) -> Iterator[Metric]:
        rounds = CounterMetricFamily(
            "hedgerow_reconcile_rounds", "Reconciler rounds by outcome.", labels=["outcome"]
        )
        counts = folded_counts("reconcile_rounds", _reconcile_counts)
        for outcome in sorted(counts):
            rounds.add_metric([outcome], counts[outcome])
        yield rounds
        last = ReconcileRun.objects.filter(skipped=False).first()
        if last is not None and last.finished_at is not None:
            yield GaugeMetricFamily(
                "hedgerow_reconcile_last_success_timestamp_seconds",
                "When the last complete reconciler round finished (unix time).",
                value=last.finished_at.timestamp(),
            )

    def _queues(self) -> Iterator[Metric]:
        queues = GaugeMetricFamily(
            "hedgerow_celery_queue_length", "Tasks waiting in each Celery queue.", labels=["queue"]
        )
        names = {settings.CELERY_TASK_DEFAULT_QUEUE}
        try:
            client = redis_client()
            for name in sorted(names):
                length = client.llen(f"{settings.REDIS_KEY_PREFIX}{name}")
                queues.add_metric([name], float(length))  # type: ignore[arg-type]
        except redis.RedisError as exc:
            log.warning("metrics: cannot read queue lengths: %s", exc)
        yield queues

    def _warm_pool(self) -> Iterator[Metric]:
        stats = warm_pool_stats()
        members = GaugeMetricFamily(
            "hedgerow_warm_pool_members",
            "Warm pool members by shape and state (warming: starting; warm: claimable).",
            labels=["shape", "state"],
        )
        targets = {shape.key(): n for shape, n in warm_pool_targets().items()}
        target = GaugeMetricFamily(
            "hedgerow_warm_pool_target", "Configured members per shape.", labels=["shape"]
        )
        for shape_key, n in sorted(targets.items()):
            target.add_metric([shape_key], n)
            for state in ("warm", "warming"):
                members.add_metric([shape_key, state], stats["members"].get((shape_key, state), 0))
        for (shape_key, state), n in sorted(stats["members"].items()):
            if shape_key not in targets:  # a shape no longer configured, still draining
                members.add_metric([shape_key, state], n)
        yield members
        yield target
        yield CounterMetricFamily(
            "hedgerow_warm_pool_claims",
            "Creates that claimed a warm member.",
            value=stats["claims"],
        )
        for name, doc in (
            ("misses", "Creates of a pooled shape that found no warm member (cold path)."),
            ("discards", "Members found dead at claim and dropped (never handed out)."),
            ("failures", "Members that failed to start."),
        ):
            if name in stats:
                yield CounterMetricFamily(f"hedgerow_warm_pool_{name}", doc, value=stats[name])


def render_metrics() -> bytes:
    """The exposition text for one scrape."""
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(HedgerowCollector())
    return generate_latest(registry)
