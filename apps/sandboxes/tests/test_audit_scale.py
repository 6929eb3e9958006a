"""The audit over a long history (issue 20): its equation is one aggregate in Postgres,
so what reaches Python (statements, rows) follows the distinct outcomes and the
sandboxes the backend holds, not how many sandboxes the period created. And the
ledger's facts it aggregates are the same as reading the ledger in order: the first
move to ``terminating`` names the reap, the last move to a final state names the
failure, events at the same instant are ordered by id."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.sandboxes.models import FINAL_STATES, Sandbox, SandboxEvent, State
from apps.sandboxes.services.audit import AuditReport, AuditSlice, audit_compute
from apps.sandboxes.services.reconcile import InventoryView

pytestmark = pytest.mark.django_db


@contextmanager
def _rows_fetched() -> Iterator[list[int]]:
    """Counts the rows every statement returned to Python (``cursor.rowcount`` of
    each SELECT), in ``counted[0]``."""
    counted = [0]

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any) -> Any:
        result = execute(sql, params, many, ctx)
        if sql.lstrip().upper().startswith(("SELECT", "WITH")):
            counted[0] += max(ctx["cursor"].rowcount, 0)
        return result

    with connection.execute_wrapper(wrapper):
        yield counted


# (final state or live, [(to_state, reason)] after ``created``) and the share of each
PATHS: list[tuple[str, list[tuple[str, str]]]] = [
    (
        State.DELETED,
        [
            ("provisioning", "scheduled"),
            ("ready", "agent_healthy"),
            ("terminating", "deleted"),
            ("deleted", "destroyed"),
        ],
    ),
    (
        State.DELETED,
        [
            ("provisioning", "scheduled"),
            ("ready", "agent_healthy"),
            ("terminating", "ttl_expired"),
            ("deleted", "destroyed"),
        ],
    ),
    (State.FAILED, [("provisioning", "scheduled"), ("failed", "provision_error")]),
    (State.LOST, [("provisioning", "scheduled"), ("ready", "agent_healthy"), ("lost", "gone")]),
    (State.PROVISIONING, [("provisioning", "scheduled")]),
]


def _add(tenant: Any, n: int, at: datetime) -> None:
    """``n`` sandboxes spread over PATHS, with their ledgers, in bulk."""
    rows: list[Sandbox] = []
    for i in range(n):
        state, _ = PATHS[i % len(PATHS)]
        rows.append(
            Sandbox(
                tenant=tenant,
                external_id=f"x-{uuid.uuid4().hex[:12]}",
                state=state,
                generation=1,
                image="host",
                cpu_millis=1000,
                memory_mib=512,
                ttl_seconds=86400,
                expires_at=at + timedelta(days=1),
                backend="local",
                created_at=at,
                terminated_at=at if state in FINAL_STATES else None,
            )
        )
    Sandbox.objects.bulk_create(rows)
    events: list[SandboxEvent] = []
    for i, s in enumerate(rows):
        _, path = PATHS[i % len(PATHS)]
        events.append(
            SandboxEvent(sandbox=s, tenant=tenant, at=at, event="created", to_state="requested")
        )
        frm = "requested"
        for k, (to, reason) in enumerate(path):
            events.append(
                SandboxEvent(
                    sandbox=s,
                    tenant=tenant,
                    at=at + timedelta(microseconds=k + 1),
                    event="transition",
                    from_state=frm,
                    to_state=to,
                    reason=reason,
                )
            )
            frm = to
    SandboxEvent.objects.bulk_create(events)


def test_the_whole_history_audit_fetches_outcomes_not_rows(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    start = timezone.now() - timedelta(days=30)
    measured: dict[int, dict[str, int]] = {}
    for n in (100, 2000):
        have = Sandbox.objects.filter(tenant=tenant).count()
        _add(tenant, n - have, start + timedelta(days=1))
        with _rows_fetched() as fetched, CaptureQueriesContext(connection) as queries:
            report = audit_compute(
                period_start=start,
                period_end=timezone.now(),
                audit_slice=AuditSlice(tenant=tenant),
                view=InventoryView(),  # the listing is given: the records are measured
            )
        # exact at either size: every sandbox in one term, with its reasons
        share = n // len(PATHS)
        assert report.created == n
        assert report.terms == {
            "deleted": share,
            "reaped_ttl": share,
            "reaped_heartbeat": 0,
            "failed": share,
            "lost": share,
            "live": share,
            "leaked": 0,
        }, report.terms
        assert report.reasons == {
            "deleted": {"deleted": share, "ttl_expired": share},
            "failed": {"provision_error": share},
            "lost": {"gone": share},
        }
        assert report.balanced and report.imbalance == {}
        measured[n] = {"rows": fetched[0], "statements": len(queries)}
    # 20x the history, the same statements and the same rows reach Python: one row
    # per distinct outcome, none per sandbox
    assert measured[2000] == measured[100], measured
    assert measured[2000]["rows"] < 20, measured


def _event(s: Sandbox, at: datetime, to: str, reason: str = "", event: str = "transition") -> Any:
    return SandboxEvent(
        sandbox=s, tenant_id=s.tenant_id, at=at, event=event, to_state=to, reason=reason
    )


def _audit(tenant: Any, start: datetime) -> AuditReport:
    return audit_compute(
        period_start=start,
        period_end=timezone.now(),
        audit_slice=AuditSlice(tenant=tenant),
        view=InventoryView(),
    )


def test_the_aggregate_reads_the_ledger_in_its_order(make_tenant: Any) -> None:
    tenant, _ = make_tenant()
    start = timezone.now() - timedelta(hours=1)
    created_at = start + timedelta(minutes=1)
    _add(tenant, 5, created_at)  # deleted, reaped_ttl, failed, lost, provisioning
    s = {x.state: x for x in Sandbox.objects.filter(tenant=tenant).exclude(state="deleted")}
    # The reaper moved it to terminating first, a user's delete at the same instant
    # came after (a higher id): the first move names it, a TTL reap.
    (reaped,) = Sandbox.objects.filter(
        tenant=tenant, events__to_state="terminating", events__reason="deleted"
    )
    SandboxEvent.objects.filter(sandbox=reaped, to_state="terminating").delete()
    moved = created_at + timedelta(microseconds=3)  # before its move to deleted (4 µs)
    SandboxEvent.objects.bulk_create(
        [
            _event(reaped, moved, "terminating", "ttl_expired"),
            _event(reaped, moved, "terminating", "deleted"),
        ]
    )
    at = start + timedelta(minutes=2)
    # two final moves at the same instant: the later id is the last
    failed = s[State.FAILED]
    SandboxEvent.objects.bulk_create(
        [_event(failed, at, "failed", "first"), _event(failed, at, "failed", "second")]
    )
    # a ledger whose last move (1 µs later) is not the row's state
    lost = s[State.LOST]
    SandboxEvent.objects.bulk_create([_event(lost, at + timedelta(microseconds=1), "ready")])
    # a ready record without a running resource: a ghost, named
    live = s[State.PROVISIONING]
    SandboxEvent.objects.bulk_create([_event(live, at, "ready", "agent_healthy")])
    Sandbox.objects.filter(pk=live.pk).update(state=State.READY)

    report = _audit(tenant, start)

    assert report.created == 5
    assert report.terms["reaped_ttl"] == 2 and report.terms["deleted"] == 0, report.terms
    assert report.reasons["failed"] == {"second": 1}
    assert report.reasons["lost"] == {"gone": 1}
    assert report.imbalance == {"ledger_disagrees": [str(lost.id)]}
    assert report.balanced is False
    assert (report.ghost_count, report.ghosts) == (1, [str(live.id)])
    assert "1 ready sandbox(es) have no running resource" in report.warnings
