"""The reclaim-leak audit: where did every sandbox created in a period go?

For a period (by creation time) and a slice (tenant, image, node, backend)::

    created = deleted + reaped_ttl + reaped_heartbeat + failed + lost + live + leaked

* ``created`` counts the ledger's ``created`` events — independently of the table, so
  a row whose ledger is missing or contradicts it shows up as an imbalance;
* ``deleted`` / ``reaped_ttl`` / ``reaped_heartbeat``: ended ``deleted``, split by
  the reason of the move to ``terminating`` (a user delete, ``ttl_expired``,
  ``heartbeat_expired``);
* ``failed`` (never became ready: ``provision_error``, ``pending_timeout``,
  ``provision_deadline``, ``queue_timeout``, ``budget_exhausted``) and ``lost`` (was
  ready, the resource vanished) are their own terms, broken down by reason;
* ``live``: not ended yet (queued, requested, provisioning, ready, terminating);
* ``leaked``: ended (any final state) but the backend still holds resources for it.
  A leaked sandbox is counted here *instead of* its final-state term.

Snapshots created in the period have their own equation (``snapshots`` in the
report; docs/snapshots.md)::

    created = deleted + expired + failed + live + leaked

where ``leaked`` is a snapshot whose record ended (deleted, expired, failed) but whose
copy the backend still keeps; unsliced audits also list the backend's snapshots with no
record at all (``orphaned``). Snapshots have no ledger of their own: ``created`` counts
their rows.

Resources outside the period's cohort that no live record owns (``orphaned``: no
record at all, or a sandbox created earlier that has ended) cannot be attributed to
this period's equation; unsliced audits list them and they make the audit fail. A ready record
whose running resource is missing (``ghost``) is also flagged: the reconciler turns it
into ``lost``. Warm pool members (started, no tenant yet) are listed apart
(``pool_members``), neither orphaned nor in any tenant's equation.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from apps.core.errors import ApiError
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.models import (
    FINAL_STATES,
    LIVE_STATES,
    AuditRun,
    AuditStatus,
    Sandbox,
    SandboxEvent,
    Snapshot,
    SnapshotState,
    State,
)
from apps.sandboxes.services.reconcile import (
    RUNNING_KINDS,
    InventoryView,
    inventory_view,
    leak_reclaim,
    sandbox_reconcile,
)
from apps.sandboxes.services.warm_pool import warm_pool_member_ids
from apps.tenancy.models import Tenant

log = logging.getLogger(__name__)

# ``queued`` (waiting for admission, no resources yet) counts as live: not ended.
PENDING_OR_LIVE = (State.QUEUED, *LIVE_STATES, State.PAUSED)  # paused: not ended
TERMS = ("deleted", "reaped_ttl", "reaped_heartbeat", "failed", "lost", "live", "leaked")
REAP_TERMS = {"ttl_expired": "reaped_ttl", "heartbeat_expired": "reaped_heartbeat"}
MAX_IDS = 200  # ids listed per flag; the counts stay exact


@dataclass(frozen=True)
class AuditSlice:
    tenant: Tenant | None = None
    image: str = ""
    node: str = ""
    backend: str = ""

    @property
    def is_global(self) -> bool:
        return self.tenant is None and not self.image

    def describe(self) -> dict[str, str]:
        return {
            "tenant": self.tenant.slug if self.tenant else "",
            "image": self.image,
            "node": self.node,
            "backend": self.backend,
        }


SNAPSHOT_TERMS = ("deleted", "expired", "failed", "live", "leaked")


@dataclass
class SnapshotAudit:
    created: int = 0
    terms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SNAPSHOT_TERMS, 0))
    leaked_ids: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)

    @property
    def balanced(self) -> bool:
        return self.created == sum(self.terms.values())

    def equation(self) -> str:
        rhs = " + ".join(f"{t} {self.terms[t]}" for t in SNAPSHOT_TERMS)
        sign = "=" if self.balanced else "≠"
        return f"snapshots created {self.created} {sign} {rhs}"


@dataclass
class AuditReport:
    period_start: datetime
    period_end: datetime
    slice: dict[str, str]
    created: int = 0
    terms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TERMS, 0))
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    orphaned: list[str] = field(default_factory=list)
    residual_by_kind: dict[str, int] = field(default_factory=dict)
    live_resources_by_kind: dict[str, int] = field(default_factory=dict)
    leaked_ids: list[str] = field(default_factory=list)
    imbalance: dict[str, list[str]] = field(default_factory=dict)
    ghosts: list[str] = field(default_factory=list)  # up to MAX_IDS of ``ghost_count``
    ghost_count: int = 0
    # Warm pool members alive in the backend: no tenant, not in the equation (a claim
    # is a tenant's ``created``), shown apart so ``leaked`` keeps its meaning.
    pool_members: int = 0
    pool_resources_by_kind: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    inventory_error: str = ""
    snapshots: SnapshotAudit = field(default_factory=SnapshotAudit)

    @property
    def accounted(self) -> int:
        return sum(self.terms.values())

    @property
    def balanced(self) -> bool:
        return (
            not self.inventory_error
            and self.created == self.accounted
            and not any(self.imbalance.values())
            and self.snapshots.balanced
        )

    @property
    def ttl_share(self) -> float:
        ended = self.terms["deleted"] + self.terms["reaped_ttl"] + self.terms["reaped_heartbeat"]
        return self.terms["reaped_ttl"] / ended if ended else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["period_start"] = self.period_start.isoformat()
        data["period_end"] = self.period_end.isoformat()
        data.update(accounted=self.accounted, balanced=self.balanced, ttl_share=self.ttl_share)
        data["equation"] = self.equation()
        data["snapshots"]["equation"] = self.snapshots.equation()
        return data

    def equation(self) -> str:
        rhs = " + ".join(f"{t} {self.terms[t]}" for t in TERMS)
        sign = "=" if self.created == self.accounted else "≠"
        pool = f"; warm pool members {self.pool_members}" if self.pool_members else ""
        return f"created {self.created} {sign} {rhs}{pool}"


def _slice_filter(prefix: str, sl: AuditSlice) -> Q:
    q = Q()
    if sl.tenant is not None:
        q &= Q(**{f"{prefix}tenant": sl.tenant})
    if sl.image:
        q &= Q(**{f"{prefix}image": sl.image})
    if sl.node:
        q &= Q(**{f"{prefix}node": sl.node})
    if sl.backend:
        q &= Q(**{f"{prefix}backend": sl.backend})
    return q


def audit_compute(
    *,
    period_start: datetime,
    period_end: datetime,
    audit_slice: AuditSlice | None = None,
    view: InventoryView | None = None,
) -> AuditReport:
    """Computes the equation for sandboxes created in [period_start, period_end).

    Read-only. Lists the backend once unless ``view`` is given; a failed listing is
    reported (``inventory_error``) and the audit is not balanced, never guessed.
    """
    sl = audit_slice or AuditSlice()
    report = AuditReport(period_start, period_end, sl.describe())
    # Records first, one snapshot, then the listing: a sandbox ended before the
    # snapshot cannot grow resources afterwards, so whatever the listing still shows
    # for it is a real leak (the reverse order would count in-flight deletes). The
    # listing runs inside the snapshot's transaction so that the records read after it
    # (the equation's one aggregate, which needs to know what the listing holds) are
    # still those of the snapshot taken before it.
    with transaction.atomic():
        if len(connection.atomic_blocks) == 1:  # not inside a caller's transaction
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                # the cohort's aggregate hashes 10^5 sandboxes' facts instead of
                # sorting them on disk (this transaction only)
                cursor.execute("SET LOCAL work_mem = '64MB'")
        snapshot_rows = _read_snapshots(period_start, period_end, sl)  # takes the snapshot
        pool_ids = warm_pool_member_ids() if sl.is_global else set()
        if view is None:
            try:
                view = inventory_view(get_backend())
            except BackendError as exc:
                report.inventory_error = str(exc)
                view = InventoryView()
        held = list(view.by_sandbox)
        running = [sid for sid, items in view.by_sandbox.items() if _is_running(items)]
        groups = _cohort_groups(period_start, period_end, sl, held=held, running=running)
        # Records anywhere in time (not just this window): a resource of a sandbox
        # created earlier is not an orphan. Only the listed ones are asked about.
        known: set[uuid.UUID] = set()
        if sl.is_global and held:
            known = set(
                Sandbox.objects.filter(pk__in=held, state__in=PENDING_OR_LIVE).values_list(
                    "id", flat=True
                )
            )
        counts = _imbalance_counts(groups)
        ids = _flagged_ids(period_start, period_end, sl, counts, running, report.inventory_error)
    if sl.is_global:
        # Read again after the listing: a member that started after the snapshot is
        # listed but was not in it. A member claimed since is in the first read.
        pool_ids |= warm_pool_member_ids()
    reasons: dict[str, Counter[str]] = {t: Counter() for t in ("failed", "lost", "deleted")}
    residual: Counter[str] = Counter()
    live_kinds: Counter[str] = Counter()
    imbalance: dict[str, list[str]] = {
        "no_created_event": ids["no_created_event"],
        "ledger_disagrees": ids["ledger_disagrees"],
    }
    row_ids: set[uuid.UUID] = set()
    for g in groups:
        if g.has_created:
            report.created += g.count
        items = view.by_sandbox.get(g.held_id, []) if g.held_id is not None else []
        if g.held_id is not None:
            row_ids.add(g.held_id)
        if g.state in FINAL_STATES and items:
            term = "leaked"
            report.leaked_ids.append(str(g.held_id))
            residual.update(item.kind for item in items)
        elif g.state in PENDING_OR_LIVE:
            term = "live"
            live_kinds.update(item.kind for item in items)
            if g.state == State.READY and not g.running and not report.inventory_error:
                report.ghost_count += g.count
        elif g.state == State.DELETED:
            term = REAP_TERMS.get(g.exit_reason, "deleted")
            reasons["deleted"][g.exit_reason or "unknown"] += g.count
        else:
            term = g.state  # failed | lost
            reasons[g.state][g.end_reason or "unknown"] += g.count
        report.terms[term] += g.count
    report.ghosts = ids["ghosts"]
    if sl.is_global:
        pool_kinds: Counter[str] = Counter()
        for sid, items in view.by_sandbox.items():
            matching = [i for i in items if not sl.node or i.node == sl.node]
            if sid in pool_ids and sid not in row_ids and sid not in known:
                if matching:
                    report.pool_members += 1
                    pool_kinds.update(item.kind for item in matching)
                continue
            if sid not in known and sid not in row_ids and matching:
                report.orphaned.append(sid.hex)
                residual.update(item.kind for item in matching)
        for item in view.unowned:
            if not sl.node or item.node == sl.node:
                report.orphaned.append(f"{item.kind}:{item.name}")
                residual[item.kind] += 1
        report.pool_resources_by_kind = dict(pool_kinds)
    report.reasons = {k: dict(v) for k, v in reasons.items() if v}
    report.residual_by_kind = dict(residual)
    report.live_resources_by_kind = dict(live_kinds)
    report.imbalance = {k: v[:MAX_IDS] for k, v in imbalance.items() if v}
    if report.created != report.accounted:
        # ``created`` counts the cohort's rows with a ``created`` event: the rows
        # without one are what the equation cannot explain.
        report.imbalance.setdefault("unexplained", ids["no_created_event"])
    report.leaked_ids = report.leaked_ids[:MAX_IDS]
    report.snapshots = _snapshot_terms(snapshot_rows, sl)
    report.warnings = _warnings(report, sl)
    if report.snapshots.leaked_ids or report.snapshots.orphaned:
        report.warnings.append(
            f"{report.snapshots.terms['leaked']} snapshot(s) leaked, "
            f"{len(report.snapshots.orphaned)} without a record: the reconciler removes them"
        )
    return report


def _read_snapshots(
    period_start: datetime, period_end: datetime, sl: AuditSlice
) -> list[tuple[uuid.UUID, str, str]]:
    """(id, state, deleted_reason) of the snapshots created in the period and slice."""
    q = Q(created_at__gte=period_start, created_at__lt=period_end)
    if sl.tenant is not None:
        q &= Q(tenant=sl.tenant)
    if sl.image:
        q &= Q(image=sl.image)
    if sl.backend:
        q &= Q(backend=sl.backend)
    if sl.node:
        q &= Q(sandbox__node=sl.node)
    return list(Snapshot.objects.filter(q).values_list("id", "state", "deleted_reason"))


def _snapshot_terms(rows: list[tuple[uuid.UUID, str, str]], sl: AuditSlice) -> SnapshotAudit:
    """Listed after the records were read: a snapshot deleted before that read whose
    copy is still listed is a real leak."""
    audit = SnapshotAudit(created=len(rows))
    listing = getattr(get_backend(), "snapshots", None)
    kept = {uuid.UUID(h) for h in listing()} if listing is not None else set()
    for sid, state, reason in rows:
        if state in (SnapshotState.CAPTURING, SnapshotState.READY):
            term = "live"
        elif sid in kept:
            term = "leaked"
            audit.leaked_ids.append(str(sid))
        elif state == SnapshotState.FAILED:
            term = "failed"
        else:
            term = "expired" if reason == "ttl_expired" else "deleted"
        audit.terms[term] += 1
    if sl.is_global:
        known = set(Snapshot.objects.filter(pk__in=list(kept)).values_list("pk", flat=True))
        audit.orphaned = sorted(str(k) for k in kept - known)[:MAX_IDS]
    audit.leaked_ids = audit.leaked_ids[:MAX_IDS]
    return audit


@dataclass(frozen=True)
class _Group:
    """Sandboxes of the cohort that share their state, ledger reasons and flags; a
    sandbox the listing holds is a group of its own (``held_id``)."""

    state: str
    exit_reason: str  # the reason of the first move to ``terminating``
    end_reason: str  # the reason of the last move to a final state
    agrees: bool  # the ledger's last ``to_state`` is the row's state
    has_created: bool  # the ledger has its ``created`` event
    running: bool  # the listing holds a running resource for it
    held_id: uuid.UUID | None
    count: int


def _cohort_where(
    period_start: datetime, period_end: datetime, sl: AuditSlice
) -> tuple[str, list[Any]]:
    where = ["sb.created_at >= %s", "sb.created_at < %s"]
    params: list[Any] = [period_start, period_end]
    if sl.tenant is not None:
        where.append("sb.tenant_id = %s")
        params.append(sl.tenant.pk)
    for column in ("image", "node", "backend"):
        value = getattr(sl, column)
        if value:
            where.append(f"sb.{column} = %s")
            params.append(value)
    return " AND ".join(where), params


# An event's place in its sandbox's ledger as text that sorts like (at, id): 20 digits
# of microseconds since the epoch, then 20 of the id, compared bytewise (``C``). Its
# ``max``/``min`` with the wanted column appended picks the last/first event's value in
# a plain (hashable) aggregate: ``array_agg(... ORDER BY at, id)`` sorts every
# sandbox's events apart, which at 10^5 sandboxes cost more than the rest together.
_LEDGER_KEY = (
    "lpad((extract(epoch FROM e.at) * 1000000)::bigint::text, 20, '0') || lpad(e.id::text, 20, '0')"
)
_KEY_LEN = 40


def _cohort_sql(
    period_start: datetime, period_end: datetime, sl: AuditSlice
) -> tuple[str, list[Any]]:
    """One row per sandbox of the cohort with its ledger's facts, aggregated in
    Postgres (a CTE body): the ledger's last ``to_state``, the reason of the first
    move to ``terminating``, the reason of the last move to a final state (by
    ``at``, then ``id``, as the ledger is ordered), and whether it has its ``created``
    event."""
    where, params = _cohort_where(period_start, period_end, sl)
    sandbox, event, n = Sandbox._meta.db_table, SandboxEvent._meta.db_table, _KEY_LEN + 1
    sql = f"""
        SELECT sb.id, sb.state,
            substr(max((k.key || e.to_state) COLLATE "C"), {n}) AS last_to,
            substr(min((k.key || e.reason) COLLATE "C")
                FILTER (WHERE e.to_state = %s), {n}) AS exit_reason,
            substr(max((k.key || e.reason) COLLATE "C")
                FILTER (WHERE e.to_state = ANY(%s)), {n}) AS end_reason,
            coalesce(bool_or(e.event = 'created'), false) AS has_created
        FROM {sandbox} sb
        LEFT JOIN {event} e
            ON e.sandbox_id = sb.id AND e.event IN ('created', 'transition')
        LEFT JOIN LATERAL (SELECT {_LEDGER_KEY} AS key) k ON true
        WHERE {where}
        GROUP BY sb.id
    """  # noqa: S608 - model metadata and fixed conditions; values are parameters
    final = [str(s) for s in FINAL_STATES]
    return sql, [str(State.TERMINATING), final, *params]


def _cohort_groups(
    period_start: datetime,
    period_end: datetime,
    sl: AuditSlice,
    *,
    held: list[uuid.UUID],
    running: list[uuid.UUID],
) -> list[_Group]:
    """The cohort counted in one statement: the rows returned follow the distinct
    (state, reasons, flags) and the sandboxes the listing holds, not the history."""
    cohort, params = _cohort_sql(period_start, period_end, sl)
    sql = f"""
        WITH f AS ({cohort})
        SELECT f.state, coalesce(f.exit_reason, ''), coalesce(f.end_reason, ''),
            f.last_to IS NOT DISTINCT FROM f.state, f.has_created, r.id IS NOT NULL,
            h.id, count(*)
        FROM f
        LEFT JOIN unnest(%s::uuid[]) AS h(id) ON h.id = f.id
        LEFT JOIN unnest(%s::uuid[]) AS r(id) ON r.id = f.id
        GROUP BY 1, 2, 3, 4, 5, 6, 7
    """  # noqa: S608 - built from model metadata, values are parameters
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, held, running])
        return [_Group(*row) for row in cursor.fetchall()]


def _is_running(items: list[Any]) -> bool:
    return bool({item.kind for item in items} & RUNNING_KINDS)


def _imbalance_counts(groups: list[_Group]) -> dict[str, int]:
    return {
        "no_created_event": sum(g.count for g in groups if not g.has_created),
        "ledger_disagrees": sum(g.count for g in groups if not g.agrees),
        "ghosts": sum(g.count for g in groups if g.state == State.READY and not g.running),
    }


def _flagged_ids(
    period_start: datetime,
    period_end: datetime,
    sl: AuditSlice,
    counts: dict[str, int],
    running: list[uuid.UUID],
    inventory_error: str,
) -> dict[str, list[str]]:
    """Up to ``MAX_IDS`` ids per flag (the counts stay exact), asked for only when
    the flag is raised: nothing is read for a balanced audit."""
    ids: dict[str, list[str]] = {"no_created_event": [], "ledger_disagrees": [], "ghosts": []}
    cohort, params = _cohort_sql(period_start, period_end, sl)
    conditions = {
        "no_created_event": "NOT f.has_created",
        "ledger_disagrees": "f.last_to IS DISTINCT FROM f.state",
    }
    with connection.cursor() as cursor:
        for flag, condition in conditions.items():
            if counts[flag]:
                sql = f"""
                    WITH f AS ({cohort}) SELECT f.id FROM f WHERE {condition}
                    ORDER BY f.id LIMIT {MAX_IDS}
                """  # noqa: S608 - fixed conditions, values are parameters
                cursor.execute(sql, params)
                ids[flag] = [str(row[0]) for row in cursor.fetchall()]
        if counts["ghosts"] and not inventory_error:
            where, where_params = _cohort_where(period_start, period_end, sl)
            sql = f"""
                SELECT sb.id FROM {Sandbox._meta.db_table} sb
                LEFT JOIN unnest(%s::uuid[]) AS r(id) ON r.id = sb.id
                WHERE {where} AND sb.state = %s AND r.id IS NULL
                ORDER BY sb.id LIMIT {MAX_IDS}
            """  # noqa: S608 - model metadata, values are parameters
            cursor.execute(sql, [running, *where_params, str(State.READY)])
            ids["ghosts"] = [str(row[0]) for row in cursor.fetchall()]
    return ids


def _warnings(report: AuditReport, sl: AuditSlice) -> list[str]:
    warnings: list[str] = []
    if report.inventory_error:
        warnings.append(f"inventory unavailable: {report.inventory_error}")
    share = report.ttl_share
    limit = settings.HEDGEROW_AUDIT_TTL_WARN_SHARE
    if share > limit:
        warnings.append(
            f"{share:.0%} of ended sandboxes were reaped by TTL (warning above {limit:.0%}): "
            "clients are not deleting what they create"
        )
    previous = AuditRun.objects.filter(
        tenant=sl.tenant, image=sl.image, node=sl.node, backend=sl.backend
    ).first()
    if previous is not None and share > previous.ttl_share + 0.05:
        warnings.append(f"TTL reap share is rising: {previous.ttl_share:.0%} → {share:.0%}")
    if report.ghost_count:
        warnings.append(f"{report.ghost_count} ready sandbox(es) have no running resource")
    return warnings


def audit_run(
    *,
    period_start: datetime | None = None,
    period_end: datetime | None = None,
    audit_slice: AuditSlice | None = None,
    reclaim: bool = False,
    trigger: str = "manual",
    view: InventoryView | None = None,
    into: AuditRun | None = None,
) -> AuditRun:
    """Computes and stores an audit (default period: the last 24 hours).

    With ``reclaim`` the leaked and orphaned resources found are removed afterwards
    (``leak_reclaimed`` in each sandbox's ledger); the stored terms are those found,
    ``reclaimed`` says how many sandboxes' resources were removed. ``into``: a
    ``running`` row (``audit_request``) to fill instead of a new one.
    """
    end = period_end or timezone.now()
    start = period_start or end - timedelta(hours=24)
    sl = audit_slice or AuditSlice()
    report = audit_compute(period_start=start, period_end=end, audit_slice=sl, view=view)
    reclaimed = audit_reclaim(report=report, view=view) if reclaim else 0
    fields: dict[str, Any] = {
        "period_start": start,
        "period_end": end,
        "tenant": sl.tenant,
        "image": sl.image,
        "node": sl.node,
        "backend": sl.backend,
        "trigger": trigger,
        "created": report.created,
        "orphaned": len(report.orphaned),
        "balanced": report.balanced and not report.orphaned,
        "ttl_share": report.ttl_share,
        "reclaimed": reclaimed,
        "report": report.as_dict(),
        "status": AuditStatus.DONE,
        **{term: report.terms[term] for term in TERMS},
    }
    if into is None:
        run = AuditRun.objects.create(**fields)
    else:
        run = into
        for name, value in fields.items():
            setattr(run, name, value)
        run.save()
    if not run.balanced or run.leaked:
        log.error(
            "leak audit: %s; leaked=%s orphaned=%s",
            report.equation(),
            run.leaked,
            run.orphaned,
            extra={"event": "audit_imbalance"},
        )
    return run


class AuditThrottled(ApiError):
    """A team's audit asked for too soon (429 + Retry-After)."""

    status_code = 429
    code = "audit_throttled"


# a ``running`` audit older than this lost its worker: it no longer blocks the next one
AUDIT_STALE_S = 900


def audit_request(
    *,
    tenant: Tenant,
    period_start: datetime | None,
    period_end: datetime | None,
    image: str = "",
) -> AuditRun:
    """A team's own audit: stored ``running`` and computed by a worker
    (``tasks.run_audit`` → ``audit_fill``), never in the web process — it lists the
    whole backend inventory. One at a time per team (``audit_in_progress``), and at
    most one per ``HEDGEROW_AUDIT_MIN_INTERVAL_S`` (``audit_throttled``), both 429 with
    ``Retry-After``."""
    from apps.sandboxes.tasks import run_audit

    end = period_end or timezone.now()
    start = period_start or end - timedelta(hours=24)
    interval = settings.HEDGEROW_AUDIT_MIN_INTERVAL_S
    with transaction.atomic():
        with connection.cursor() as cursor:  # concurrent requests of a team queue here
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))",
                [f"hedgerow-audit:{settings.HEDGEROW_INSTANCE}:{tenant.pk}"],
            )
        now = timezone.now()
        mine = AuditRun.objects.filter(tenant=tenant, trigger="manual")
        running = mine.filter(
            status=AuditStatus.RUNNING, created_at__gte=now - timedelta(seconds=AUDIT_STALE_S)
        ).first()
        if running is not None:
            raise AuditThrottled(
                f"audit {running.pk} of this team is still running",
                code="audit_in_progress",
                headers={"Retry-After": "5"},
                extra={"audit_id": running.pk},
            )
        last = mine.order_by("-created_at").first()
        if last is not None:
            wait = interval - (now - last.created_at).total_seconds()
            if wait > 0:
                raise AuditThrottled(
                    f"one audit per {interval:.0f} s per team; the last one ran "
                    f"{(now - last.created_at).total_seconds():.0f} s ago",
                    headers={"Retry-After": str(max(1, int(wait + 0.999)))},
                )
        run = AuditRun.objects.create(
            period_start=start,
            period_end=end,
            tenant=tenant,
            image=image,
            trigger="manual",
            status=AuditStatus.RUNNING,
        )
        transaction.on_commit(lambda: run_audit.delay(run.pk))
    return run


def audit_request_installation(*, reconcile: bool, reclaim: bool) -> AuditRun:
    """The staff page's "Run audit now": an installation-wide audit (of the last 24
    hours, after a reconciler round if ``reconcile``) stored ``running`` and computed
    by a worker (``tasks.run_audit`` → ``audit_fill``). Not in the web process: it
    lists the backend's inventory, which the web's service account may not do on
    Kubernetes. One at a time: while one is running, asking again returns it."""
    from apps.sandboxes.tasks import run_audit

    end = timezone.now()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))",
                [f"hedgerow-audit:{settings.HEDGEROW_INSTANCE}:installation"],
            )
        running = AuditRun.objects.filter(
            tenant=None,
            image="",
            node="",
            backend="",
            status=AuditStatus.RUNNING,
            created_at__gte=end - timedelta(seconds=AUDIT_STALE_S),
        ).first()
        if running is not None:
            return running
        run = AuditRun.objects.create(
            period_start=end - timedelta(hours=24),
            period_end=end,
            trigger="manual",
            status=AuditStatus.RUNNING,
            report={"requested": {"reconcile": reconcile, "reclaim": reclaim}},
        )
        transaction.on_commit(lambda: run_audit.delay(run.pk))
    return run


def audit_fill(run_id: int) -> AuditRun | None:
    """The worker's half of ``audit_request`` and ``audit_request_installation``:
    computes the audit into its row."""
    run = AuditRun.objects.filter(pk=run_id, status=AuditStatus.RUNNING).first()
    if run is None:
        return None  # done already (a redelivered task) or gone
    requested = (run.report or {}).get("requested") or {}
    start, end = run.period_start, run.period_end
    try:
        if requested:  # staff's "audit now": as of now, after the round it asked for
            if requested.get("reconcile"):
                sandbox_reconcile()
            end = timezone.now()
            start = end - (run.period_end - run.period_start)
        return audit_run(
            period_start=start,
            period_end=end,
            audit_slice=AuditSlice(tenant=run.tenant, image=run.image),
            trigger=run.trigger,
            reclaim=bool(requested.get("reclaim")),
            into=run,
        )
    except Exception as exc:
        AuditRun.objects.filter(pk=run_id).update(
            status=AuditStatus.FAILED, balanced=False, error=str(exc)[:1000]
        )
        raise


def audit_reclaim(*, report: AuditReport, view: InventoryView | None = None) -> int:
    """Removes the resources of the report's leaked and orphaned sandboxes. Returns how
    many were reclaimed; a resource that cannot be removed is logged and skipped."""
    backend = get_backend()
    view = view or inventory_view(backend)
    targets: list[tuple[uuid.UUID | None, str]] = [
        (uuid.UUID(sid), "audit_leak") for sid in report.leaked_ids
    ]
    targets += [
        (uuid.UUID(hex=o), "audit_orphan") for o in report.orphaned if ":" not in o and len(o) == 32
    ]
    count = 0
    for sid, reason in targets:
        items = view.by_sandbox.get(sid, []) if sid else []
        try:
            leak_reclaim(backend=backend, sandbox_uuid_=sid, items=items, reason=reason)
            count += 1
        except BackendError as exc:
            log.warning("could not reclaim %s: %s", sid, exc)
    if any(":" in o for o in report.orphaned):
        try:
            leak_reclaim(backend=backend, sandbox_uuid_=None, items=view.unowned, reason="orphan")
            count += 1
        except BackendError as exc:
            log.warning("could not reclaim unowned resources: %s", exc)
    return count


def audit_scheduled(*, now: datetime | None = None) -> list[AuditRun]:
    """The beat task's work: one installation-wide audit over the last period, plus one
    per tenant that created sandboxes in it (the dashboard's history). Shares one
    inventory listing. Never reclaims: that is the reconciler's job, so an audit shows
    what the reconciler missed."""
    end = now or timezone.now()
    start = end - timedelta(seconds=settings.HEDGEROW_AUDIT_PERIOD_S)
    try:
        view: InventoryView | None = inventory_view(get_backend())
    except BackendError:
        view = None  # each audit reports the error itself
    runs = [audit_run(period_start=start, period_end=end, trigger="scheduled", view=view)]
    tenant_ids = (
        Sandbox.objects.filter(created_at__gte=start, created_at__lt=end)
        .values_list("tenant_id", flat=True)
        .distinct()
    )
    for tenant in Tenant.objects.filter(pk__in=list(tenant_ids)):
        runs.append(
            audit_run(
                period_start=start,
                period_end=end,
                audit_slice=AuditSlice(tenant=tenant),
                trigger="scheduled",
                view=view,
            )
        )
    return runs
