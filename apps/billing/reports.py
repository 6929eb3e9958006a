"""Roll-ups and reports over the usage ledger: per day, per tenant, image and label,
next to what the same usage would cost at hosted list prices."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.billing.models import DailyUsage, PriceBook, TenantQuota, UsageRecord
from apps.billing.pricing import (
    HOUR,
    money,
    price_book_in_force,
    price_rate,
    reference_books,
)
from apps.billing.storage import storage_totals
from apps.billing.usage import (
    Totals,
    month_start,
    record_window,
    records_overlapping,
    tenant_window_cost,
)
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
    ending as another starts is never counted twice."""
    now = now or timezone.now()
    events: list[tuple[datetime, int]] = []
    rows = records_overlapping(start=start, end=end, tenant=tenant).only("started_at", "ended_at")
    for record in rows.iterator():
        lo, hi = max(record.started_at, start), min(record.ended_at or now, end)
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
    slices = [("total", ""), ("image", record.image)]
    slices += [("label", f"{k}={v}"[:300]) for k, v in sorted(record.labels.items())]
    return slices


def daily_usage_rebuild(*, day: date) -> int:
    """Recomputes every roll-up row of ``day`` from the usage ledger (live sandboxes
    accrued to now). Idempotent: the day's rows are replaced in one transaction."""
    start, end = day_bounds(day)
    now = timezone.now()
    acc: dict[tuple[str, str, str], Totals] = defaultdict(Totals)
    for record in records_overlapping(start=start, end=end).iterator():
        share = record_window(record, start=start, end=end, now=now)
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
    with transaction.atomic():
        DailyUsage.objects.filter(day=day).delete()
        DailyUsage.objects.bulk_create(rows)
    return len(rows)


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


def cost_by_key(*, tenant: Tenant, start: datetime, end: datetime) -> list[dict[str, Any]]:
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


def tenant_report(*, tenant: Tenant, start: datetime, end: datetime) -> TenantReport:
    """Usage of one tenant in [start, end), per UTC day and sliced by image and label,
    computed from the ledger directly (exact, includes live accrual)."""
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
            per_day[day].add(record, record_window(record, start=lo, end=hi, now=now))
            day += timedelta(days=1)
    days = []
    day = start.date()
    while datetime.combine(day, time.min, tzinfo=UTC) < end:
        days.append({"day": day.isoformat(), **_totals_dict(per_day.get(day, Totals()))})
        day += timedelta(days=1)
    slices = sorted(per_slice.items(), key=lambda kv: kv[1].cost, reverse=True)
    quota = TenantQuota.objects.filter(tenant=tenant).first()
    # Month to date in one SQL aggregate (the admission check's arithmetic), not a
    # second walk of every record: the report's cost grew with the month's history.
    month_cost = tenant_window_cost(tenant=tenant, start=month_start(now), now=now)
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
