"""The result's UPDATE of an operation is a HOT update (issue 17 goal 3, migration
0016): no index covers a column it writes, so Postgres writes no index entry for it,
counted by Postgres itself (``pg_stat_xact_user_tables``: this transaction's updates
and HOT updates). And the recovery sweep, which found running rows through the
``(status, created_at)`` index that made those updates non-HOT, still finds every one
of them, reading the rows since its last round rather than the whole table."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from apps.core.redis_sync import redis_client
from apps.sandboxes.models import MetricsFold, Operation, OperationStatus, Sandbox, State
from apps.sandboxes.services.exec_async import _FINISH_SQL
from apps.sandboxes.services.operations import RESULT_COLUMNS, operation_finish, result_fields
from apps.sandboxes.services.recovery import RECOVERY_MARK, operation_recover_stale
from apps.sandboxes.services.streaming import pump_key
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db

TABLE = Operation._meta.db_table


def _counts() -> tuple[int, int, int]:
    """(updates, HOT updates, rows read) of the operation table in this transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(n_tup_upd, 0), coalesce(n_tup_hot_upd, 0), "
            "coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = %s",
            [TABLE],
        )
        row = cursor.fetchone()
    return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)


def _operation(sandbox: Sandbox, *, created_at: Any = None, **fields: Any) -> Operation:
    return Operation.objects.create(
        tenant=sandbox.tenant,
        sandbox=sandbox,
        operation_id=f"op-{uuid.uuid4().hex}",
        generation=sandbox.generation,
        request={"command": "echo hi"},
        request_hash="x" * 64,
        created_at=created_at or timezone.now(),
        **fields,
    )


def test_no_index_of_the_operation_table_covers_a_column_the_result_writes() -> None:
    """Any index on a column the UPDATE changes — in its key, expression or predicate —
    makes every result UPDATE write a new entry into every index of the table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) "
            "FROM pg_index WHERE indrelid = %s::regclass",
            [TABLE],
        )
        indexes = dict(cursor.fetchall())
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [TABLE])
        options = cursor.fetchone()[0]
    by_name = {field.name: field.column for field in Operation._meta.concrete_fields}
    columns = [by_name[name] for name in RESULT_COLUMNS]
    covering = {
        name: definition
        for name, definition in indexes.items()
        if any(re.search(rf"\b{column}\b", definition) for column in columns)
    }
    assert covering == {}
    assert len(indexes) == 4  # pkey, unique (sandbox, operation_id), created_at, tenant
    assert options == ["fillfactor=85"]  # room on the page for the row's new version
    # The event loop's UPDATE sets exactly those columns (and matches on id, status).
    assigned = re.findall(r"(\w+) = \$\d+", _FINISH_SQL.split("WHERE")[0])
    assert assigned == columns


def test_the_result_update_writes_no_index_entry(make_tenant: Any) -> None:
    tenant, _secret = make_tenant()
    sandbox = make_sandbox(tenant)
    updates, hot, _read = _counts()
    for _ in range(20):  # each row finished after it was inserted, as execs are
        operation = _operation(sandbox)
        result = {
            "termination": {"reason": "exited", "exit_code": 0},
            "stdout": {"data": "hi\n" * 40},
            "stderr": {"data": ""},
            "usage": {"cpu_ms": 1},
        }
        assert operation_finish(operation.pk, result_fields(result))
    after_updates, after_hot, _read = _counts()
    assert (after_updates - updates, after_hot - hot) == (20, 20)
    stored = Operation.objects.filter(sandbox=sandbox).values_list("status", flat=True)
    assert set(stored) == {OperationStatus.COMPLETED}


@pytest.fixture
def live_pumps() -> Iterator[list[str]]:
    """Relay leases claimed by the test ("a live process still relays it")."""
    keys: list[str] = []
    yield keys
    if keys:
        redis_client().delete(*keys)


def test_the_sweep_finds_running_rows_behind_its_mark(
    make_tenant: Any, live_pumps: list[str]
) -> None:
    tenant, _secret = make_tenant()
    gone = make_sandbox(tenant, state=State.DELETED)
    ten_minutes_ago = timezone.now() - timedelta(minutes=10)
    orphan = _operation(gone, created_at=ten_minutes_ago)
    relayed = _operation(gone, created_at=ten_minutes_ago)
    live_pumps.append(pump_key(str(relayed.pk)))
    redis_client().set(live_pumps[0], "someone", ex=60)
    fresh = _operation(gone)  # newer than the recovery delay: not yet the sweep's

    assert operation_recover_stale() == {"failed": 1, "running": 1}
    orphan.refresh_from_db()
    assert orphan.status == OperationStatus.FAILED
    assert orphan.error is not None and orphan.error["code"] == "sandbox_gone"
    mark = MetricsFold.objects.get(name=RECOVERY_MARK)
    after = timedelta(seconds=settings.HEDGEROW_OPERATION_RECOVERY_AFTER_S)
    assert mark.through <= timezone.now() - after
    assert mark.counts == {"running": [str(relayed.pk)]}  # left to its relay, carried
    assert Operation.objects.get(pk=fresh.pk).status == OperationStatus.RUNNING

    # A row stamped before the mark but visible only now (its transaction was slow)
    # is inside the margin of the next window.
    late = _operation(gone, created_at=mark.through - after)
    redis_client().delete(live_pumps[0])  # the relay died
    later = timezone.now() + 2 * after
    assert operation_recover_stale(now=later) == {"failed": 3}
    statuses = Operation.objects.filter(pk__in=[relayed.pk, late.pk, fresh.pk])
    assert set(statuses.values_list("status", flat=True)) == {OperationStatus.FAILED}
    mark.refresh_from_db()
    # Never past the real clock, whatever ``now`` the caller passed.
    assert mark.through <= timezone.now() - after
    assert mark.counts == {"running": []}


def test_the_sweep_reads_the_rows_since_its_last_round_not_the_table(make_tenant: Any) -> None:
    """The rows a sweep reads follow the execs since the last round, at 100 and 2,000
    finished operations: after the first round (which reads everything once)."""
    tenant, _secret = make_tenant()
    sandbox = make_sandbox(tenant, state=State.DELETED)
    read: list[int] = []
    for n in (100, 2000):
        old = timezone.now() - timedelta(days=1)
        Operation.objects.bulk_create(
            Operation(
                tenant=tenant,
                sandbox=sandbox,
                operation_id=f"op-{uuid.uuid4().hex}",
                generation=1,
                request_hash="x" * 64,
                status=OperationStatus.COMPLETED,
                created_at=old,
                finished_at=old,
            )
            for _ in range(n)
        )
        MetricsFold.objects.filter(name=RECOVERY_MARK).delete()
        stuck = _operation(sandbox, created_at=timezone.now() - timedelta(minutes=5))
        assert operation_recover_stale() == {"failed": 1}  # the first round: all of it
        stuck.delete()
        stuck = _operation(sandbox, created_at=timezone.now() - timedelta(seconds=45))
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")  # sizes this small tempt it
        _updates, _hot, before = _counts()
        assert operation_recover_stale() == {"failed": 1}
        read.append(_counts()[2] - before)
        assert Operation.objects.get(pk=stuck.pk).status == OperationStatus.FAILED
        stuck.delete()  # not in the next round's window
    assert read[0] == read[1], read
