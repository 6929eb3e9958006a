"""Roll-ups and reports over the usage ledger: per day, per tenant, image and label,
next to what the same usage would cost at hosted list prices."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from apps.billing.models import DailyUsage, DailyUsageDay, PriceBook, TenantQuota, UsageRecord
from apps.billing.pricing import (
    HOUR,
    gibs,
    money,
    price_book_in_force,
    price_rate,
    reference_books,
    seconds_of,
    vcpus,
)
from apps.billing.storage import storage_totals, storage_window_cost
from apps.billing.usage import (
    LATE_WRITE,
    Totals,
    month_start,
    record_window,
    records_overlapping,
    tenant_window_cost,
)
from apps.billing.usage import WindowUsage as RecordShare
from apps.tenancy.models import ApiKey, Tenant


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


def peak_concurrency(
    *, tenant: Tenant, start: datetime, end: datetime, now: datetime | None = None
) -> list[dict[str, Any]]:
    """The most sandboxes the team held at once on each UTC day of [start, end), from
    the usage ledger (one interval per sandbox; a live one runs to ``now``): a sweep
    over start/end instants, where instants that tie are applied together so a sandbox
    ending as another starts is never counted twice. A whole day whose roll-up is final
    is read from its ``peak`` row (``daily_usage_rebuild`` runs the same sweep over the
    day), the other days swept from the records, one run of days at a time."""
    days, rolled, partial = _window_days(start=start, end=end)
    read = rolled | set(partial)
    peaks: dict[date, int] = {}
    held: dict[date, int] = {}  # open at a partial day's cut
    rows = DailyUsage.objects.filter(
        tenant=tenant, day__in=read, dimension__in=["peak", "open:peak"]
    ).values_list("day", "dimension", "sandboxes")
    for day, dimension, sandboxes in rows:
        (peaks if dimension == "peak" else held)[day] = sandboxes
    out: dict[str, int] = {d.isoformat(): peaks.get(d, 0) for d in read}
    for run in _runs(days, rolled, partial):
        sweeps = []
        if _is_cut(run[0], partial):  # the rest of a partly rolled day, on its own
            d, lo, hi = run[0]
            sweeps.append(
                _peak_sweep(tenant=tenant, start=lo, end=hi, now=now, open_at_start=held.get(d, 0))
            )
            run = run[1:]
        if run:
            sweeps.append(_peak_sweep(tenant=tenant, start=run[0][1], end=run[-1][2], now=now))
        for sweep in sweeps:
            for row in sweep:
                # a partly rolled day: the most of its rolled part and of the rest
                # (whose sweep starts with what is held at the cut)
                out[row["day"]] = max(row["peak"], out.get(row["day"], 0))
    return [{"day": d.isoformat(), "peak": out[d.isoformat()]} for d, _, _, _ in days]


def _window_days(
    *, start: datetime, end: datetime
) -> tuple[list[tuple[date, datetime, datetime, bool]], set[date], dict[date, datetime]]:
    """The UTC days of [start, end) as (day, lo, hi, whole), those of them whose roll-up
    is final (``DailyUsageDay``: cut after the day ended, not stale), and those whose
    roll-up holds a first part of the window's share of them: {day: cut} for a day the
    window holds from its midnight and the roll-up was cut inside it, before the
    window's end (today's partial roll-up) — the roll-up answers [midnight, cut), the
    records the rest."""
    days: list[tuple[date, datetime, datetime, bool]] = []
    day = start.date()
    while datetime.combine(day, time.min, tzinfo=UTC) < end:
        d0, d1 = day_bounds(day)
        lo, hi = max(start, d0), min(end, d1)
        days.append((day, lo, hi, lo == d0 and hi == d1))
        day += timedelta(days=1)
    final: dict[date, datetime | None] = dict(
        DailyUsageDay.objects.filter(
            day__gte=days[0][0], day__lte=days[-1][0], stale=False, computed_at__isnull=False
        ).values_list("day", "computed_at")
    )
    rolled = set()
    partial: dict[date, datetime] = {}
    for d, lo, hi, whole in days:
        at = final.get(d)
        if at is None:
            continue
        if whole and at >= hi:
            rolled.add(d)
        elif lo == day_bounds(d)[0] and lo < at <= hi:
            partial[d] = at
    return days, rolled, partial


def _runs(
    days: list[tuple[date, datetime, datetime, bool]],
    rolled: set[date],
    partial: dict[date, datetime] | None = None,
) -> list[list[tuple[date, datetime, datetime]]]:
    """Runs of consecutive parts of days the roll-up does not answer, each part (day,
    lo, hi): a day not rolled up whole, or the rest of a partly rolled day after its
    cut."""
    partial = partial or {}
    runs: list[list[tuple[date, datetime, datetime]]] = []
    for d, lo, hi, _ in days:
        if d in rolled:
            continue
        lo = partial.get(d, lo)
        if lo >= hi:
            continue
        if runs and runs[-1][-1][2] == lo:
            runs[-1].append((d, lo, hi))
        else:
            runs.append([(d, lo, hi)])
    return runs


def _is_cut(part: tuple[date, datetime, datetime], partial: dict[date, datetime]) -> bool:
    """Whether ``part`` is the rest of a partly rolled day after its cut."""
    return partial.get(part[0]) == part[1]


def _peak_of(spans: list[tuple[datetime, datetime]]) -> int:
    """The most of ``spans`` (lo, hi) that overlap at once; ties applied together."""
    events = sorted([(lo, 1) for lo, _ in spans] + [(hi, -1) for _, hi in spans])
    peak = current = index = 0
    while index < len(events):
        instant = events[index][0]
        while index < len(events) and events[index][0] == instant:
            current += events[index][1]
            index += 1
        peak = max(peak, current)
    return peak


# The sweep in one statement: each record's span clipped to the window gives a +1 and
# a -1 instant; instants that tie are summed first (applied together), then a running
# sum over time is the number held after each instant. Per UTC day: the most held after
# any of its instants, the number held after its last one (held over into the next
# day) and its first instant (a day that starts with an instant at midnight does not
# count what was held just before it). Identifiers are the model's table name.
_PEAK_SQL = f"""
WITH spans AS (
  SELECT GREATEST(r.started_at, %(start)s) AS lo,
         LEAST(COALESCE(r.ended_at, %(now)s), %(end)s) AS hi,
         r.started_at >= %(start)s AS new
  FROM "{UsageRecord._meta.db_table}" r
  WHERE r.tenant_id = %(tenant)s AND r.started_at < %(end)s
    AND (r.ended_at IS NULL OR r.ended_at > %(start)s)
    AND (%(all)s OR r.started_at >= %(start)s OR r.ended_at > %(start)s)
), instants AS (
  SELECT t, SUM(d) AS d FROM (
    SELECT lo AS t, 1 AS d FROM spans WHERE lo < hi AND (%(all)s OR new)
    UNION ALL SELECT hi, -1 FROM spans WHERE lo < hi
    UNION ALL SELECT %(start)s, %(held)s WHERE %(held)s > 0
  ) ev GROUP BY t
), held AS (
  SELECT t, SUM(d) OVER (ORDER BY t) AS n FROM instants
)
SELECT (t AT TIME ZONE 'UTC')::date, MAX(n), (ARRAY_AGG(n ORDER BY t DESC))[1], MIN(t)
FROM held GROUP BY 1
"""  # noqa: S608


def _peak_sweep(
    *,
    tenant: Tenant,
    start: datetime,
    end: datetime,
    now: datetime | None = None,
    open_at_start: int | None = None,
) -> list[dict[str, Any]]:
    """``peak_concurrency`` from the records of [start, end): one statement that returns
    a row per day with instants (the records stay in Postgres; reading each one's two
    datetimes into Python was most of the usage page's time at 12,000 records a day).
    Same answer as the Python sweep ``_peak_sweep_walk`` (tested). ``open_at_start``:
    the number of records open at ``start`` (today's partial roll-up keeps it at its
    cut): then only the records started or ended since are read, not every live one."""
    now = now or timezone.now()
    params: dict[str, Any] = {
        "tenant": tenant.pk,
        "start": start,
        "end": end,
        "now": now,
        "all": open_at_start is None,
        "held": open_at_start or 0,
    }
    with connection.cursor() as cursor:
        cursor.execute(_PEAK_SQL, params)
        per_day = {row[0]: (int(row[1]), int(row[2]), row[3]) for row in cursor.fetchall()}
    days: list[dict[str, Any]] = []
    held = 0  # held over from the days before
    day = start.date()
    while datetime.combine(day, time.min, tzinfo=UTC) < end:
        lo, _ = day_bounds(day)
        peak = held
        if day in per_day:
            most, last, first = per_day[day]
            peak = most if first == lo else max(most, held)
            held = last
        days.append({"day": day.isoformat(), "peak": peak})
        day += timedelta(days=1)
    return days


def _peak_sweep_walk(
    *, tenant: Tenant, start: datetime, end: datetime, now: datetime | None = None
) -> list[dict[str, Any]]:
    """``peak_concurrency`` from the records of [start, end), swept in Python: the
    reference ``_peak_sweep`` (one SQL statement) is tested against."""
    now = now or timezone.now()
    events: list[tuple[datetime, int]] = []
    # two columns as tuples: a model instance per record was most of this sweep's time
    # (16,000 records of a month's unrolled days: 0.25 s, docs/benchmarks.md)
    rows = records_overlapping(start=start, end=end, tenant=tenant).values_list(
        "started_at", "ended_at"
    )
    for started_at, ended_at in rows.iterator():
        lo, hi = max(started_at, start), min(ended_at or now, end)
        if lo < hi:
            events += [(lo, 1), (hi, -1)]
    events.sort()
    days: list[dict[str, Any]] = []
    current = index = 0
    day = start.date()
    while datetime.combine(day, time.min, tzinfo=UTC) < end:
        lo, hi = day_bounds(day)
        at_start = index < len(events) and events[index][0] == lo
        peak = 0 if at_start else current  # held over from the day before
        while index < len(events) and events[index][0] < hi:
            instant = events[index][0]
            while index < len(events) and events[index][0] == instant:
                current += events[index][1]
                index += 1
            peak = max(peak, current)
        days.append({"day": day.isoformat(), "peak": peak})
        day += timedelta(days=1)
    return days


def _slices(record: UsageRecord) -> list[tuple[str, str]]:
    creator = getattr(record, "creator", None)
    if creator is None:
        creator = record.sandbox.created_by
    return _slices_of(record.image, record.labels, record.price_book_id, creator)


def _key_of(creator: str) -> str:
    """The API key prefix a sandbox was created with (``key:<prefix>``), or ``""`` for
    the dashboard and staff."""
    return creator.removeprefix("key:") if creator.startswith("key:") else ""


def _slices_of(
    image: str, labels: dict[str, Any], book: int, creator: str
) -> list[tuple[str, str]]:
    """The roll-up's rows a record counts in: the total, its image, each label, its
    price book (the report names the books a window was priced with) and the API key
    that created its sandbox (``cost_by_key``)."""
    slices = [("total", ""), ("image", image)]
    slices += [("label", f"{k}={v}"[:300]) for k, v in sorted(labels.items())]
    return [*slices, ("book", str(book)), ("key", _key_of(creator))]


def rollup_cut(*, now: datetime) -> datetime:
    """Where a roll-up read now may cut the open day: ``LATE_WRITE`` before now or
    before the oldest transaction in flight in this database that has written, whichever
    is earlier. A write the roll-up's read cannot see is in flight or comes later; when
    on time (its event time within ``LATE_WRITE`` of its statement) it falls after the
    cut, where the report reads the records, and when late it marks the day stale
    (``daily_usage_invalidate``). Needs the sessions of the app's role visible in
    ``pg_stat_activity`` (the same role, or ``pg_read_all_stats``)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT min(xact_start) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_xid IS NOT NULL"
        )
        row = cursor.fetchone()
    oldest = row[0] if row and row[0] is not None else now
    return min(now, oldest) - LATE_WRITE


def daily_usage_rebuild(*, day: date) -> int:
    """Recomputes every roll-up row of ``day`` from the usage ledger. Idempotent: the
    day's rows are replaced in one transaction. The rows hold [midnight, cut) with the
    cut from ``rollup_cut`` (``DailyUsageDay.computed_at``): the whole day once the cut
    is past its end (final), else the open day's first part, which the report reads
    with the records after the cut (today's partial roll-up, every round of the task)."""
    start, end = day_bounds(day)
    marker, _ = DailyUsageDay.objects.get_or_create(day=day)
    version = marker.version  # read before the records: a late write after this bumps it
    now = timezone.now()
    cut = rollup_cut(now=now)  # before the records are read
    until = min(end, cut)
    acc: dict[tuple[str, str, str], Totals] = defaultdict(Totals)
    spans: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    if until > start:
        records = records_overlapping(start=start, end=until).annotate(
            creator=F("sandbox__created_by")
        )
    else:  # cut before the day began: nothing of it to roll up yet
        records = UsageRecord.objects.none().annotate(creator=F("sandbox__created_by"))
    partial = until < end
    # A partial roll-up also keeps what is open at its cut: per tenant how many (for
    # the peak), and per slice their count and summed vCPU, memory and hourly rate
    # (those with a pause begun before the cut aside: read with the paused records), so
    # a report adds (now - cut) x these sums and reads only records started or ended
    # since the cut (``_add_changes``).
    held: dict[str, int] = defaultdict(int)
    opened: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0, 0, 0, Decimal(0)])
    for record in records.iterator():
        tenant_id = str(record.tenant_id)
        if partial and (record.ended_at is None or record.ended_at > until):
            held[tenant_id] += 1
            if not any(datetime.fromisoformat(b) < until for b, _ in record.pauses or []):
                for dimension, value in _slices(record):
                    sums = opened[(tenant_id, f"open:{dimension}", value)]
                    sums[0] += 1
                    sums[1] += record.cpu_millis
                    sums[2] += record.memory_mib
                    sums[3] += record.hourly_rate
        lo, hi = max(record.started_at, start), min(record.ended_at or now, until)
        if lo < hi:
            spans[str(record.tenant_id)].append((lo, hi))
        share = record_window(record, start=start, end=until, now=now)
        if share.seconds == 0 and not share.started_inside:
            continue
        for dimension, value in _slices(record):
            acc[(str(record.tenant_id), dimension, value)].add(record, share)
    rows = [
        DailyUsage(
            tenant_id=tenant_id,
            day=day,
            dimension=dimension,
            value=value,
            sandboxes=t.sandboxes,
            sandbox_seconds=t.sandbox_seconds.quantize(Decimal("0.001")),
            vcpu_seconds=t.vcpu_seconds.quantize(Decimal("0.001")),
            gib_seconds=t.gib_seconds.quantize(Decimal("0.001")),
            cost=t.cost.quantize(Decimal("0.0000000001")),
            computed_at=now,
        )
        for (tenant_id, dimension, value), t in acc.items()
    ]
    # the day's peak concurrency per tenant (``peak_concurrency``), in ``sandboxes``
    rows += [
        DailyUsage(
            tenant_id=tenant_id,
            day=day,
            dimension="peak",
            value="",
            sandboxes=_peak_of(tenant_spans),
            computed_at=now,
        )
        for tenant_id, tenant_spans in spans.items()
    ]
    # open at the cut: count, summed cpu_millis, memory_mib and hourly rate per slice
    rows += [
        DailyUsage(
            tenant_id=tenant_id,
            day=day,
            dimension=dimension,
            value=value,
            sandboxes=n,
            vcpu_seconds=cpu,
            gib_seconds=mem,
            cost=rate.quantize(Decimal("0.0000000001")),
            computed_at=now,
        )
        for (tenant_id, dimension, value), (n, cpu, mem, rate) in opened.items()
    ]
    rows += [
        DailyUsage(
            tenant_id=tenant_id,
            day=day,
            dimension="open:peak",
            value="",
            sandboxes=n,
            computed_at=now,
        )
        for tenant_id, n in held.items()
    ]
    with transaction.atomic():
        DailyUsage.objects.filter(day=day).delete()
        DailyUsage.objects.bulk_create(rows)
        # Final only when no late write came in while the records were read.
        DailyUsageDay.objects.filter(day=day).update(computed_at=cut)
        DailyUsageDay.objects.filter(day=day, version=version).update(stale=False)
    return len(rows)


def daily_usage_stale_days(*, limit: int = 7) -> list[date]:
    """Finished days a late write made stale, oldest first (the roll-up task's work)."""
    return list(
        DailyUsageDay.objects.filter(stale=True)
        .order_by("day")
        .values_list("day", flat=True)[:limit]
    )


def reference_costs(
    *, vcpu_seconds: Decimal, gib_seconds: Decimal, sandboxes: int, at: datetime
) -> list[dict[str, Any]]:
    """What the same vCPU-seconds and GiB-seconds cost at each hosted list price."""
    out = []
    for book in reference_books(at=at):
        rate = price_rate(book=book, capacity_type="on_demand")
        cost = (
            vcpu_seconds / HOUR * rate.vcpu_hour
            + gib_seconds / HOUR * rate.gib_hour
            + sandboxes * rate.startup_fee
        )
        out.append({"slug": book.slug, "name": book.name, "cost": money(cost)})
    return out


@dataclass
class TenantReport:
    tenant: Tenant
    start: datetime
    end: datetime
    totals: Totals
    days: list[dict[str, Any]] = field(default_factory=list)
    by_image: list[dict[str, Any]] = field(default_factory=list)
    by_label: list[dict[str, Any]] = field(default_factory=list)
    references: list[dict[str, Any]] = field(default_factory=list)
    budget: Decimal | None = None
    month_cost: Decimal = Decimal(0)
    price_books: list[str] = field(default_factory=list)
    # kept state (snapshots, pauses) in the window: {kind: {"gib_hours", "cost"}}
    storage: dict[str, dict[str, Decimal]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        t = self.totals
        return {
            "tenant": self.tenant.slug,
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "totals": _totals_dict(t),
            "days": self.days,
            "by_image": self.by_image,
            "by_label": self.by_label,
            "hosted_comparison": [{**r, "cost": str(r["cost"])} for r in self.references],
            "month_to_date": {
                "cost": str(money(self.month_cost)),
                "budget": str(self.budget) if self.budget is not None else None,
            },
            "price_books": self.price_books,
            "storage": {
                kind: {
                    "gib_hours": str(v["gib_hours"].quantize(Decimal("0.0001"))),
                    "cost": str(money(v["cost"])),
                }
                for kind, v in self.storage.items()
            },
        }


def _totals_dict(t: Totals) -> dict[str, Any]:
    return {
        "sandboxes": t.sandboxes,
        "sandbox_hours": str((t.sandbox_seconds / HOUR).quantize(Decimal("0.0001"))),
        "vcpu_hours": str((t.vcpu_seconds / HOUR).quantize(Decimal("0.0001"))),
        "gib_hours": str((t.gib_seconds / HOUR).quantize(Decimal("0.0001"))),
        "cost": str(money(t.cost)),
        # unrounded (µ$): a slice of a few small sandboxes costs under a cent, which
        # the pages show as "<$0.01" rather than a misleading "$0.00"
        "cost_exact": str(t.cost.quantize(Decimal("0.000001"))),
    }


def cost_by_key_walk(*, tenant: Tenant, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """The window's usage per API key that created the sandboxes (the sandbox's
    ``created_by``, ``key:<prefix>``; the key's name when it still exists), most
    expensive first. Sandboxes created from the dashboard or by staff are one row,
    ``key`` empty, so the rows add up to the period's total."""
    now = timezone.now()
    per_creator: dict[str, Totals] = defaultdict(Totals)
    records = records_overlapping(start=start, end=end, tenant=tenant).select_related("sandbox")
    for record in records.iterator():
        creator = record.sandbox.created_by
        prefix = creator.removeprefix("key:") if creator.startswith("key:") else ""
        per_creator[prefix].add(record, record_window(record, start=start, end=end, now=now))
    names = dict(
        ApiKey.objects.filter(tenant=tenant, prefix__in=list(per_creator)).values_list(
            "prefix", "name"
        )
    )
    # most expensive first; ties: keys by prefix, then the dashboard's row
    rows = sorted(per_creator.items(), key=lambda kv: (-kv[1].cost, kv[0] == "", kv[0]))
    return [{"key": prefix, "name": names.get(prefix, ""), **_totals_dict(t)} for prefix, t in rows]


def tenant_report_walk(*, tenant: Tenant, start: datetime, end: datetime) -> TenantReport:
    """``tenant_report`` computed by walking every record of the window in Python: the
    reference the roll-up path is tested against (``test_usage_rollup_report.py``); its
    cost grows with the records in the window."""
    now = timezone.now()
    totals = Totals()
    per_day: dict[date, Totals] = defaultdict(Totals)
    per_slice: dict[tuple[str, str], Totals] = defaultdict(Totals)
    books: set[int] = set()
    for record in records_overlapping(start=start, end=end, tenant=tenant).iterator():
        share = record_window(record, start=start, end=end, now=now)
        totals.add(record, share)
        books.add(record.price_book_id)
        for dimension, value in _slices(record)[1:]:
            per_slice[(dimension, value)].add(record, share)
        day = max(record.started_at, start).date()
        while datetime.combine(day, time.min, tzinfo=UTC) < min(record.ended_at or now, end):
            lo, hi = day_bounds(day)
            lo, hi = max(lo, start), min(hi, end)
            per_day[day].add(record, record_window(record, start=lo, end=hi, now=now))
            day += timedelta(days=1)
    month_cost = tenant_window_cost(tenant=tenant, start=month_start(now), now=now)
    return _report(tenant, start, end, totals, per_day, per_slice, books, month_cost)


# One statement for the parts of a window the roll-up cannot answer (today, a day
# not final, a partial day at either end): the records overlapping each part, summed
# per part and per everything the price and the slices depend on. Identifiers are the
# models' table names, no input.
_SANDBOX_TABLE = UsageRecord._meta.get_field("sandbox").related_model._meta.db_table  # type: ignore[union-attr]
_PARTS_SQL = f"""
SELECT p.i, r.image, r.labels::text, s.created_by, r.cpu_millis, r.memory_mib,
       r.hourly_rate, r.startup_fee, r.price_book_id,
       SUM(GREATEST(EXTRACT(EPOCH FROM LEAST(COALESCE(r.ended_at, %(now)s), p.hi)
                                   - GREATEST(r.started_at, p.lo)), 0)),
       COUNT(*) FILTER (WHERE r.started_at >= p.lo)
FROM "{UsageRecord._meta.db_table}" r
JOIN "{_SANDBOX_TABLE}" s ON s.id = r.sandbox_id
JOIN unnest(%(los)s::timestamptz[], %(his)s::timestamptz[]) WITH ORDINALITY AS p(lo, hi, i)
  ON r.started_at < p.hi AND (r.ended_at IS NULL OR r.ended_at > p.lo)
WHERE r.tenant_id = %(tenant)s AND r.pauses = '[]'::jsonb
  AND r.started_at < %(end)s AND (r.ended_at IS NULL OR r.ended_at > %(start)s)
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9
"""  # noqa: S608

# The rest of a partly rolled day after its cut, [start, end), when the roll-up keeps
# the sums of the records open at the cut (added as (upto - cut) x sums, upto = min(end,
# now)): only records started since the cut, summed as above, and records open at the
# cut that ended since, each taking back what the sums gave it after its end (negative
# seconds, no start). A live record open at the cut is not read at all.
_CHANGES_SQL = f"""
SELECT 1, r.image, r.labels::text, s.created_by, r.cpu_millis, r.memory_mib,
       r.hourly_rate, r.startup_fee, r.price_book_id,
       SUM(CASE WHEN r.started_at < %(start)s
                THEN EXTRACT(EPOCH FROM LEAST(r.ended_at, %(upto)s) - %(upto)s::timestamptz)
                ELSE GREATEST(EXTRACT(EPOCH FROM LEAST(COALESCE(r.ended_at, %(now)s), %(end)s)
                                               - r.started_at), 0) END),
       COUNT(*) FILTER (WHERE r.started_at >= %(start)s)
FROM "{UsageRecord._meta.db_table}" r
JOIN "{_SANDBOX_TABLE}" s ON s.id = r.sandbox_id
WHERE r.tenant_id = %(tenant)s AND r.pauses = '[]'::jsonb AND r.started_at < %(end)s
  AND (r.started_at >= %(start)s OR r.ended_at > %(start)s)
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9
"""  # noqa: S608

# The same sums for a caller that needs only the totals (the quota bars' month to
# date): no slices, so no join to the sandbox for its creator and no grouping by the
# labels' text — grouped only by what the price depends on.
_TOTALS_SQL = (
    _PARTS_SQL.replace("r.image, r.labels::text, s.created_by", "NULL, NULL, NULL")
    .replace(f'JOIN "{_SANDBOX_TABLE}" s ON s.id = r.sandbox_id\n', "")
    .replace("GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9", "GROUP BY 1, 5, 6, 7, 8, 9")
)
_CHANGES_TOTALS_SQL = (
    _CHANGES_SQL.replace("r.image, r.labels::text, s.created_by", "NULL, NULL, NULL")
    .replace(f'JOIN "{_SANDBOX_TABLE}" s ON s.id = r.sandbox_id\n', "")
    .replace("GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9", "GROUP BY 1, 5, 6, 7, 8, 9")
)


@dataclass
class WindowUsage:
    """A tenant's usage in [start, end): the total, per UTC day, per slice
    (``(dimension, value)``: image, label, key) and the price books used."""

    totals: Totals = field(default_factory=Totals)
    per_day: dict[date, Totals] = field(default_factory=lambda: defaultdict(Totals))
    per_slice: dict[tuple[str, str], Totals] = field(default_factory=lambda: defaultdict(Totals))
    books: set[int] = field(default_factory=set)
    now: datetime | None = None  # live records accrued to this


def _add_summed_row(out: WindowUsage, day: date, row: tuple[Any, ...], *, slices: bool) -> None:
    """One summed row of ``_PARTS_SQL`` / ``_CHANGES_SQL`` (image, labels, creator, cpu,
    memory, rate, fee, price book, seconds, starts) into the totals, ``day`` and, with
    ``slices``, the image / label / key slices."""
    image, labels, creator, cpu, mem, rate, fee, book, seconds, starts = row
    out.books.add(book)
    summed = {
        "seconds": seconds,
        "starts": starts,
        "cpu_millis": cpu,
        "memory_mib": mem,
        "rate": rate,
        "fee": fee,
    }
    _add_sum(out.totals, **summed)
    _add_sum(out.per_day[day], **summed)
    if not slices:
        return
    for dimension, value in _slices_of(image, json.loads(labels), book, creator):
        if dimension in ("image", "label", "key"):
            _add_sum(out.per_slice[(dimension, value)], **summed)


def _add_sum(
    t: Totals,
    *,
    seconds: Decimal,
    starts: int,
    cpu_millis: int,
    memory_mib: int,
    rate: Decimal,
    fee: Decimal,
) -> None:
    """``Totals.add`` for ``starts`` records' summed ``seconds`` at one price and shape
    (cost and resources are linear in the seconds)."""
    t.sandboxes += starts
    t.sandbox_seconds += seconds
    t.vcpu_seconds += seconds * vcpus(cpu_millis)
    t.gib_seconds += seconds * gibs(memory_mib)
    t.cost += seconds / HOUR * rate + starts * fee


def window_usage(
    *,
    tenant: Tenant,
    start: datetime,
    end: datetime,
    slices: bool = True,
    now: datetime | None = None,
) -> WindowUsage:
    """The tenant's usage in [start, end) at a cost that does not grow with the history:
    each whole UTC day whose roll-up is final (``DailyUsageDay``) is read from
    ``DailyUsage`` (a few rows per day); the rest — today, a day not rolled up or made
    stale by a late write, a partial day at either end — from the records overlapping
    those parts, summed in one SQL statement (records with pauses, rare, through
    ``record_window``). Same arithmetic as walking every record (``tenant_report_walk``),
    to the roll-up's rounding (10⁻³ s, 10⁻¹⁰ $). ``slices=False``: the totals and days
    only (``per_slice`` left empty), read with a lighter statement."""
    now = now or timezone.now()
    out = WindowUsage(now=now)
    days, rolled, partial = _window_days(start=start, end=end)
    rolled_rows = (
        DailyUsage.objects.filter(tenant=tenant, day__in=rolled | set(partial))
        .exclude(dimension__in=["peak", "open:peak"])
        .values_list(
            "day",
            "dimension",
            "value",
            "sandboxes",
            "sandbox_seconds",
            "vcpu_seconds",
            "gib_seconds",
            "cost",
        )
    )
    opened: dict[date, list[tuple[str, str, int, Decimal, Decimal, Decimal]]] = defaultdict(list)
    # tuples, not model instances: a month holds ~60 rows a day per slice set
    for day, dimension, value, sandboxes, seconds, vcpu_s, gib_s, cost in rolled_rows:
        if dimension.startswith("open:"):
            opened[day].append((dimension[5:], value, sandboxes, vcpu_s, gib_s, cost))
            continue
        t = Totals(
            sandboxes=sandboxes,
            sandbox_seconds=seconds,
            vcpu_seconds=vcpu_s,
            gib_seconds=gib_s,
            cost=cost,
        )
        if dimension == "total":
            _merge(out.per_day[day], t)
            _merge(out.totals, t)
        elif dimension == "book":
            out.books.add(int(value))
        elif slices:
            _merge(out.per_slice[(dimension, value)], t)
    # each run of days not rolled up read on its own: the records' read follows the
    # run (``ended_at`` index), not the whole window around it
    for run in _runs(days, rolled, partial):
        if _is_cut(run[0], partial):  # the rest of a partly rolled day, on its own
            _add_changes(out, tenant=tenant, part=run[0], opened=opened, now=now, slices=slices)
            run = run[1:]
        if run:
            _add_records(out, tenant=tenant, parts=run, now=now, slices=slices)
    return out


def _open_share(*, seconds: Decimal, n: int, cpu: Decimal, mem: Decimal, rate: Decimal) -> Totals:
    """What ``n`` records open at a cut, with summed ``cpu`` millis, ``mem`` MiB and
    hourly ``rate``, add over ``seconds`` after it (no starts: they began before)."""
    return Totals(
        sandbox_seconds=seconds * n,
        vcpu_seconds=seconds * cpu / 1000,
        gib_seconds=seconds * mem / 1024,
        cost=seconds / HOUR * rate,
    )


def _negated(t: Totals) -> Totals:
    return Totals(
        sandboxes=-t.sandboxes,
        sandbox_seconds=-t.sandbox_seconds,
        vcpu_seconds=-t.vcpu_seconds,
        gib_seconds=-t.gib_seconds,
        cost=-t.cost,
    )


def _add_changes(
    out: WindowUsage,
    *,
    tenant: Tenant,
    part: tuple[date, datetime, datetime],
    opened: dict[date, list[tuple[str, str, int, Decimal, Decimal, Decimal]]],
    now: datetime,
    slices: bool,
) -> None:
    """Adds the rest of a partly rolled day, ``part`` = (day, cut, hi): the records
    open at the cut from the roll-up's sums, then only the records that started or
    ended since the cut (``_CHANGES_SQL``), and the paused ones."""
    day, cut, hi = part
    upto = min(hi, now)
    after = seconds_of(upto - cut) if upto > cut else Decimal(0)
    for dimension, value, n, cpu, mem, rate in opened.get(day, []):
        t = _open_share(seconds=after, n=n, cpu=cpu, mem=mem, rate=rate)
        if dimension == "total":
            _merge(out.per_day[day], t)
            _merge(out.totals, t)
        elif dimension == "book":
            out.books.add(int(value))
        elif slices and dimension in ("image", "label", "key"):
            _merge(out.per_slice[(dimension, value)], t)
    with connection.cursor() as cursor:
        cursor.execute(
            _CHANGES_SQL if slices else _CHANGES_TOTALS_SQL,
            {"now": now, "upto": upto, "tenant": tenant.pk, "start": cut, "end": hi},
        )
        rows = cursor.fetchall()
    for row in rows:
        _add_summed_row(out, day, row[1:], slices=slices)
    paused = (
        records_overlapping(start=cut, end=hi, tenant=tenant)
        .exclude(pauses=[])
        .annotate(creator=F("sandbox__created_by"))
    )
    for record in paused:
        share = record_window(record, start=cut, end=hi, now=now)
        begun = [datetime.fromisoformat(b) for b, _ in record.pauses]
        if record.started_at < cut and not any(b < cut for b in begun):
            # in the roll-up's sums (no pause yet at the cut): take their share back
            back = _negated(
                _open_share(
                    seconds=after,
                    n=1,
                    cpu=Decimal(record.cpu_millis),
                    mem=Decimal(record.memory_mib),
                    rate=record.hourly_rate,
                )
            )
        else:
            back = None
        _add_record_share(out, record, share, day, slices=slices, back=back)


def _add_record_share(
    out: WindowUsage,
    record: UsageRecord,
    share: RecordShare,
    day: date,
    *,
    slices: bool,
    back: Totals | None = None,
) -> None:
    """One record's ``share`` of a window (a paused record, read one by one) into the
    totals, ``day`` and, with ``slices``, the image / label / key slices; ``back`` is
    taken off each (what a partial roll-up's sums already gave it)."""
    out.books.add(record.price_book_id)
    targets = [out.totals, out.per_day[day]]
    if slices:
        targets += [
            out.per_slice[(dimension, value)]
            for dimension, value in _slices(record)
            if dimension in ("image", "label", "key")
        ]
    for t in targets:
        t.add(record, share)
        if back is not None:
            _merge(t, back)


def _add_records(
    out: WindowUsage,
    *,
    tenant: Tenant,
    parts: list[tuple[date, datetime, datetime]],
    now: datetime,
    slices: bool,
) -> None:
    """Adds the usage of consecutive ``parts`` (day, lo, hi) from the records."""
    with connection.cursor() as cursor:
        cursor.execute(
            _PARTS_SQL if slices else _TOTALS_SQL,
            {
                "now": now,
                "los": [lo for _, lo, _ in parts],
                "his": [hi for _, _, hi in parts],
                "tenant": tenant.pk,
                "start": parts[0][1],
                "end": parts[-1][2],
            },
        )
        rows = cursor.fetchall()
    for row in rows:
        _add_summed_row(out, parts[row[0] - 1][0], row[1:], slices=slices)
    paused = (
        records_overlapping(start=parts[0][1], end=parts[-1][2], tenant=tenant)
        .exclude(pauses=[])
        .annotate(creator=F("sandbox__created_by"))
    )
    for record in paused:
        for part_day, lo, hi in parts:
            if record.started_at >= hi or (record.ended_at is not None and record.ended_at <= lo):
                continue
            share = record_window(record, start=lo, end=hi, now=now)
            _add_record_share(out, record, share, part_day, slices=slices)


def month_to_date_cost(*, tenant: Tenant, now: datetime | None = None) -> Decimal:
    """``tenant_month_cost`` without walking the month's records: its finished days from
    the roll-up and today from its partial roll-up and the records since
    (``window_usage``), plus the kept state's storage. Every reader of the month to date
    uses it — the quota bars on every page, the budget check on every create, the
    budget notices and their banner — so they agree; ``tenant_month_cost`` (every
    record) stays as the reference the tests compare it with."""
    now = now or timezone.now()
    month = month_start(now)
    cost = window_usage(tenant=tenant, start=month, end=now, slices=False).totals.cost
    return cost + storage_window_cost(tenant=tenant, start=month, now=now)


def _merge(into: Totals, t: Totals) -> None:
    into.sandboxes += t.sandboxes
    into.sandbox_seconds += t.sandbox_seconds
    into.vcpu_seconds += t.vcpu_seconds
    into.gib_seconds += t.gib_seconds
    into.cost += t.cost


def cost_by_key(*, tenant: Tenant, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """The window's usage per API key that created the sandboxes (the sandbox's
    ``created_by``, ``key:<prefix>``; the key's name when it still exists), most
    expensive first. Sandboxes created from the dashboard or by staff are one row,
    ``key`` empty, so the rows add up to the period's total. From ``window_usage``."""
    return cost_by_key_of(tenant, window_usage(tenant=tenant, start=start, end=end))


def cost_by_key_of(tenant: Tenant, usage: WindowUsage) -> list[dict[str, Any]]:
    """``cost_by_key`` from a window's usage already read (its ``key`` slices)."""
    per_creator = {v: t for (d, v), t in usage.per_slice.items() if d == "key"}
    names = dict(
        ApiKey.objects.filter(tenant=tenant, prefix__in=list(per_creator)).values_list(
            "prefix", "name"
        )
    )
    rows = sorted(per_creator.items(), key=lambda kv: (-kv[1].cost, kv[0] == "", kv[0]))
    return [{"key": prefix, "name": names.get(prefix, ""), **_totals_dict(t)} for prefix, t in rows]


def tenant_report(
    *, tenant: Tenant, start: datetime, end: datetime, usage: WindowUsage | None = None
) -> TenantReport:
    """Usage of one tenant in [start, end), per UTC day and sliced by image and label,
    live sandboxes accrued to now: closed days from the daily roll-up, the rest from
    the ledger (``window_usage``); its cost follows the window, not the history.
    ``usage``: the window's ``window_usage`` when the caller read it already (the usage
    page shares one read between the report and cost per key)."""
    if usage is None:
        usage = window_usage(tenant=tenant, start=start, end=end)
    month_cost = month_cost_within(usage, tenant=tenant, start=start, end=end)
    if month_cost is None:
        month_cost = month_to_date_cost(tenant=tenant, now=usage.now)
    return _report(
        tenant, start, end, usage.totals, usage.per_day, usage.per_slice, usage.books, month_cost
    )


def month_cost_within(
    usage: WindowUsage, *, tenant: Tenant, start: datetime, end: datetime
) -> Decimal | None:
    """The month to date (``month_to_date_cost``) from a window's usage already read,
    when the window holds the whole month to now (the usage page's default window: the
    last 30 days to now, when it reaches back to the 1st): the sum of its days from the
    1st, plus the kept state's storage. None when it does not hold it."""
    now = usage.now
    if now is None or end < now:
        return None
    month = month_start(now)
    if start > month:
        return None
    cost = sum((t.cost for day, t in usage.per_day.items() if day >= month.date()), Decimal(0))
    return cost + storage_window_cost(tenant=tenant, start=month, now=now)


def _report(
    tenant: Tenant,
    start: datetime,
    end: datetime,
    totals: Totals,
    per_day: dict[date, Totals],
    per_slice: dict[tuple[str, str], Totals],
    books: set[int],
    month_cost: Decimal,
) -> TenantReport:
    days = []
    day = start.date()
    while datetime.combine(day, time.min, tzinfo=UTC) < end:
        days.append({"day": day.isoformat(), **_totals_dict(per_day.get(day, Totals()))})
        day += timedelta(days=1)
    # most expensive first; ties by name (the order does not depend on the records')
    slices = sorted(per_slice.items(), key=lambda kv: (-kv[1].cost, kv[0]))
    quota = TenantQuota.objects.filter(tenant=tenant).first()
    return TenantReport(
        tenant=tenant,
        start=start,
        end=end,
        totals=totals,
        days=days,
        by_image=[{"image": v, **_totals_dict(t)} for (d, v), t in slices if d == "image"],
        by_label=[{"label": v, **_totals_dict(t)} for (d, v), t in slices if d == "label"],
        references=reference_costs(
            vcpu_seconds=totals.vcpu_seconds,
            gib_seconds=totals.gib_seconds,
            sandboxes=totals.sandboxes,
            at=end,
        ),
        budget=quota.monthly_budget if quota else None,
        month_cost=month_cost,
        storage=storage_totals(tenant=tenant, start=start, end=end),
        price_books=[str(b) for b in PriceBook.objects.filter(pk__in=books).order_by("slug")],
    )


COST_REPORT_COLUMNS = [
    "tenant",
    "sandboxes",
    "sandbox_hours",
    "vcpu_hours",
    "gib_hours",
    "cost",
    "e2b",
    "daytona",
    "modal",
    "price_books",
]


def cost_report(*, start: datetime, end: datetime, sort: str = "-cost") -> list[dict[str, Any]]:
    """All tenants with usage in [start, end): one row each, sortable by any column
    (prefix ``-`` for descending). Money as Decimal rounded to the cent."""
    now = timezone.now()
    per_tenant: dict[str, Totals] = defaultdict(Totals)
    books: dict[str, set[int]] = defaultdict(set)
    for record in records_overlapping(start=start, end=end).iterator():
        per_tenant[str(record.tenant_id)].add(
            record, record_window(record, start=start, end=end, now=now)
        )
        books[str(record.tenant_id)].add(record.price_book_id)
    names = {str(t.pk): t.slug for t in Tenant.objects.filter(pk__in=list(per_tenant))}
    book_names = {b.pk: str(b) for b in PriceBook.objects.all()}
    rows = []
    for tenant_id, t in per_tenant.items():
        refs = {
            r["slug"]: r["cost"]
            for r in reference_costs(
                vcpu_seconds=t.vcpu_seconds,
                gib_seconds=t.gib_seconds,
                sandboxes=t.sandboxes,
                at=end,
            )
        }
        rows.append(
            {
                "tenant": names.get(tenant_id, tenant_id),
                "sandboxes": t.sandboxes,
                "sandbox_hours": (t.sandbox_seconds / HOUR).quantize(Decimal("0.0001")),
                "vcpu_hours": (t.vcpu_seconds / HOUR).quantize(Decimal("0.0001")),
                "gib_hours": (t.gib_seconds / HOUR).quantize(Decimal("0.0001")),
                "cost": money(t.cost),
                "e2b": refs.get("e2b", Decimal(0)),
                "daytona": refs.get("daytona", Decimal(0)),
                "modal": refs.get("modal", Decimal(0)),
                "price_books": ", ".join(sorted(book_names[b] for b in books[tenant_id])),
            }
        )
    key = sort.lstrip("-")
    if key not in COST_REPORT_COLUMNS:
        key = "cost"
    rows.sort(key=lambda r: r[key], reverse=sort.startswith("-"))
    return rows


def current_price_book() -> PriceBook:
    return price_book_in_force(at=timezone.now())
