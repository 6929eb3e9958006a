"""Prometheus metrics, computed from the database and Redis at scrape time.

Why not in-process counters: the facts happen in many processes (web workers, Celery
workers, the watcher) that start and die independently; the ledger and operation rows
already record every one of them. Reading them at scrape time makes every web process
report the same, complete numbers, with no multiprocess bookkeeping. No scrape reads
every row: the counters over the append-only ledger and the reconciler's rounds read
only the rows since their fold (``services/metrics_fold.py``); the sandbox gauge, the
two histograms and the error counter are kept on write by triggers and folded here
(``services/metrics_tally.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime

import redis
from django.conf import settings
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
    SandboxEvent,
    State,
)
from apps.sandboxes.services.audit import TERMS
from apps.sandboxes.services.metrics_fold import folded_counts
from apps.sandboxes.services.metrics_tally import Tally, tallies
from apps.sandboxes.services.warm_pool import (
    CLAIM_REASON,
    warm_pool_stats,
    warm_pool_targets,
)
from apps.tenancy.models import Tenant

log = logging.getLogger(__name__)

READY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
AUTOMATIC_ACTORS = ("reaper", "reconciler", "watcher", "system")


def _histogram(
    name: str, doc: str, tally: Tally | None, buckets: tuple[float, ...]
) -> HistogramMetricFamily:
    """A histogram from its tally: counts per bucket (1-based index of the first bound
    at or above the value, ``len + 1`` above them all) made cumulative, and the sum."""
    tally = tally or Tally()
    cumulative, running = [], 0
    for index in range(1, len(buckets) + 1):
        running += tally.counts.get(str(index), 0)
        cumulative.append(running)
    total = running + tally.counts.get(str(len(buckets) + 1), 0)
    metric = HistogramMetricFamily(name, doc)
    metric.add_metric(
        [],
        [(repr(le), float(c)) for le, c in zip(buckets, cumulative, strict=True)]
        + [("+Inf", float(total))],
        float(tally.total()),
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


def _claim_counts(lo: datetime, hi: datetime | None) -> dict[str, int]:
    """Warm pool claims (ledger transitions with the claim reason) stamped in [lo, hi)."""
    rows = SandboxEvent.objects.filter(at__gte=lo, event="transition", reason=CLAIM_REASON)
    if hi is not None:
        rows = rows.filter(at__lt=hi)
    return {"claims": rows.count()}


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
        # kept on write by triggers and folded here: this reads what changed since the
        # last scrape, not every sandbox and operation (services/metrics_tally.py)
        kept = tallies()
        yield from self._sandboxes(kept.get("sandboxes") or Tally())
        yield _histogram(
            "hedgerow_sandbox_create_to_ready_seconds",
            "Time from the create request to the agent answering /health.",
            kept.get("ready"),
            READY_BUCKETS,
        )
        yield _histogram(
            "hedgerow_exec_duration_seconds",
            "Exec wall time as the control plane saw it (request recorded to result stored).",
            kept.get("exec"),
            EXEC_BUCKETS,
        )
        yield from self._actions()
        yield from self._agent_errors(kept.get("errors") or Tally())
        yield from self._audit()
        yield from self._reconcile()
        yield from self._queues()
        yield from self._warm_pool()

    def _sandboxes(self, tally: Tally) -> Iterator[Metric]:
        by_state = GaugeMetricFamily(
            "hedgerow_sandboxes", "Sandboxes by state and tenant.", labels=["state", "tenant"]
        )
        keyed: list[tuple[str, str, int]] = []
        for key, n in tally.counts.items():
            if n:
                state, tenant_id = key.split("|", 1)
                keyed.append((state, tenant_id, n))
        slugs = {
            str(pk): slug
            for pk, slug in Tenant.objects.filter(pk__in={t for _, t, _ in keyed}).values_list(
                "pk", "slug"
            )
        }
        for state, slug, n in sorted((state, slugs.get(t, t), n) for state, t, n in keyed):
            by_state.add_metric([state, slug], n)
        yield by_state
        depth = GaugeMetricFamily(
            "hedgerow_admission_queue_depth",
            "Sandboxes admitted but not started: waiting for capacity (queued) or for a "
            "worker to pick them up (requested).",
            labels=["stage"],
        )
        for stage in ("queued", State.REQUESTED):
            depth.add_metric([str(stage)], sum(n for state, _, n in keyed if state == str(stage)))
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

    def _agent_errors(self, tally: Tally) -> Iterator[Metric]:
        errors = CounterMetricFamily(
            "hedgerow_agent_errors",
            "Operations that ended failed (agent unreachable, agent error, interrupted…).",
            labels=["code"],
        )
        for code in sorted(tally.counts):
            if tally.counts[code]:
                errors.add_metric([code], tally.counts[code])
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
            value=folded_counts("warm_pool_claims", _claim_counts).get("claims", 0),
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
