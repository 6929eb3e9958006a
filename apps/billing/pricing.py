"""Price books: which prices apply when, and the cost formula. Money is Decimal only.

cost = billable_hours × (vCPU × price_vcpu_hour + GiB × price_gib_hour) + startup_fee
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.db import IntegrityError, transaction

from apps.billing.models import CapacityType, PriceBook, PriceRate
from apps.core.errors import ServiceUnavailable

CENT = Decimal("0.01")
HOUR = Decimal(3600)
REFERENCE_SLUGS = ("e2b", "daytona", "modal")


def money(value: Decimal) -> Decimal:
    """Rounds to the cent, half up (what an invoice shows)."""
    return value.quantize(CENT, rounding=ROUND_HALF_UP)


def seconds_of(delta: timedelta) -> Decimal:
    """Exact seconds of a timedelta (no float on the way)."""
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 10**6


def vcpus(cpu_millis: int) -> Decimal:
    return Decimal(cpu_millis) / 1000


def gibs(memory_mib: int) -> Decimal:
    return Decimal(memory_mib) / 1024


# The seed (migration 0003) again, for a database whose price books were emptied (a
# test flush, a careless admin): an installation always has prices to bill with.
# Rows: capacity type, vCPU-hour, GiB-hour (memory), startup fee, storage GiB-hour.
STORAGE_GIB_HOUR = "0.00014"  # stored state: ≈ $0.10 per GiB-month (migration 0006)
DEFAULT_BOOKS: list[tuple[str, str, bool, list[tuple[str, str, str, str, str]]]] = [
    (
        "hedgerow",
        "Hedgerow default",
        False,
        [
            ("on_demand", "0.04", "0.005", "0.0005", STORAGE_GIB_HOUR),
            ("spot", "0.012", "0.0015", "0.0005", STORAGE_GIB_HOUR),
        ],
    ),
    ("e2b", "E2B (list price)", True, [("on_demand", "0.0504", "0.0162", "0", "0")]),
    ("daytona", "Daytona (list price)", True, [("on_demand", "0.0504", "0.0162", "0", "0")]),
    ("modal", "Modal (list price)", True, [("on_demand", "0.070956", "0.024192", "0", "0")]),
]
EPOCH = datetime(2020, 1, 1, tzinfo=UTC)


def price_books_ensure() -> None:
    """Creates the default and reference books (version 1) if no book of that slug
    exists. Idempotent and safe under concurrency (unique slug+version)."""
    for slug, name, is_reference, rates in DEFAULT_BOOKS:
        if PriceBook.objects.filter(slug=slug).exists():
            continue
        try:
            with transaction.atomic():
                book = PriceBook.objects.create(
                    slug=slug, name=name, version=1, is_reference=is_reference, effective_from=EPOCH
                )
                for capacity, vcpu_hour, gib_hour, fee, storage in rates:
                    PriceRate.objects.create(
                        price_book=book,
                        capacity_type=capacity,
                        vcpu_hour=Decimal(vcpu_hour),
                        gib_hour=Decimal(gib_hour),
                        startup_fee=Decimal(fee),
                        storage_gib_hour=Decimal(storage),
                    )
        except IntegrityError:
            continue  # a concurrent caller made it


def price_book_in_force(*, at: datetime) -> PriceBook:
    """The newest non-reference book whose ``effective_from`` ≤ ``at``."""
    in_force = PriceBook.objects.filter(is_reference=False, effective_from__lte=at).order_by(
        "-effective_from", "-version"
    )
    # Every provision prices its sandbox here: look for the book first, and only when
    # there is none check whether the defaults were never created.
    book = in_force.first()
    if book is None and not PriceBook.objects.filter(is_reference=False).exists():
        price_books_ensure()
        book = in_force.first()
    if book is None:
        raise ServiceUnavailable(
            f"no price book is in force at {at.isoformat()}", code="no_price_book"
        )
    return book


def price_rate(*, book: PriceBook, capacity_type: str) -> PriceRate:
    """The book's row for the capacity type; books without a spot row bill spot on demand."""
    rates = {rate.capacity_type: rate for rate in book.rates.all()}
    rate = rates.get(capacity_type) or rates.get(CapacityType.ON_DEMAND)
    if rate is None:
        raise ServiceUnavailable(f"price book {book} has no on-demand row", code="no_price_book")
    return rate


def hourly_rate(*, cpu_millis: int, memory_mib: int, rate: PriceRate) -> Decimal:
    return vcpus(cpu_millis) * rate.vcpu_hour + gibs(memory_mib) * rate.gib_hour


def cost_of(*, cpu_millis: int, memory_mib: int, seconds: Decimal, rate: PriceRate) -> Decimal:
    """Unrounded cost of one sandbox that ran ``seconds`` at ``rate`` (incl. startup fee)."""
    per_hour = hourly_rate(cpu_millis=cpu_millis, memory_mib=memory_mib, rate=rate)
    return seconds / HOUR * per_hour + rate.startup_fee


def reference_books(*, at: datetime) -> list[PriceBook]:
    """The newest version of each hosted reference book in force at ``at``."""
    books: list[PriceBook] = []
    if not PriceBook.objects.filter(is_reference=True).exists():
        price_books_ensure()
    for slug in REFERENCE_SLUGS:
        book = (
            PriceBook.objects.filter(slug=slug, is_reference=True, effective_from__lte=at)
            .order_by("-effective_from", "-version")
            .prefetch_related("rates")
            .first()
        )
        if book is not None:
            books.append(book)
    return books
