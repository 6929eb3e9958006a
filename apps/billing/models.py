"""Money: quotas and hot-path limits, price books, the usage ledger and its daily
roll-up. Tenants, members and keys are ``apps.tenancy``."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from apps.tenancy.models import ApiKey, Tenant


class TenantQuota(models.Model):
    """A tenant's limits. One row per tenant; admission locks it (``select_for_update``) so
    concurrent creates of one tenant are counted one at a time. Null means unlimited."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    max_concurrent_sandboxes = models.PositiveIntegerField(null=True, blank=True)
    max_cpu_millis = models.PositiveIntegerField(
        null=True, blank=True, help_text="total vCPU (millicores) of live sandboxes"
    )
    max_memory_mib = models.PositiveIntegerField(
        null=True, blank=True, help_text="total memory (MiB) of live sandboxes"
    )
    max_lifetime_s = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_execs = models.PositiveIntegerField(null=True, blank=True)
    exec_rate_per_s = models.FloatField(null=True, blank=True, help_text="token refill rate")
    exec_burst = models.PositiveIntegerField(null=True, blank=True, help_text="bucket size")
    max_upload_bytes = models.BigIntegerField(null=True, blank=True)
    upload_bytes_per_day = models.BigIntegerField(null=True, blank=True)
    max_pty_sessions = models.PositiveIntegerField(null=True, blank=True)
    max_snapshot_bytes = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="total bytes of kept snapshots, paused sandboxes' state included",
    )
    monthly_budget = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    # Set by the team's owners (the budget above is staff's hard cap): the Usage page
    # warns once month-to-date spend reaches it. Null: no alert.
    budget_alert = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    # The team's own hard cap, set by its owners (never above what staff allow: the
    # lower of the two refuses creates). Null: none of the team's own.
    team_budget = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    # Where a crossed alert or budget is POSTed (owners set it; it may carry a token,
    # so it is never shown back, logged or exported: only whether one is set).
    alert_webhook_url = models.CharField(max_length=2000, blank=True, default="")
    queue_by_default = models.BooleanField(
        default=False, help_text="creates over a limit wait in the admission queue"
    )
    max_queued = models.PositiveIntegerField(default=1000)
    # Egress (docs/egress.md): whether sandboxes may have egress "all", and the patterns
    # an allowlist's entries must fall under (null: any).
    egress_allow_all = models.BooleanField(
        default=True, help_text="sandboxes may have egress 'all' (network_access)"
    )
    egress_patterns = models.JSONField(
        null=True,
        blank=True,
        help_text="names, *.wildcards and CIDR:port an allowlist may use; null: any",
    )
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"quota of {self.tenant_id}"


class ApiKeyLimits(models.Model):
    """Optional per-key limits, tighter than the tenant's (e.g. one CI key that must not
    take the whole team's concurrency)."""

    api_key = models.OneToOneField(ApiKey, on_delete=models.CASCADE, related_name="limits")
    max_concurrent_sandboxes = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_execs = models.PositiveIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"limits of {self.api_key_id}"


class CapacityType(models.TextChoices):
    ON_DEMAND = "on_demand"
    SPOT = "spot"


class PriceBook(models.Model):
    """A versioned price list. The book in force at time t is the newest (highest
    ``effective_from`` ≤ t) non-reference book; reference books are hosted list prices
    used only for comparison."""

    slug = models.SlugField(max_length=64)
    name = models.CharField(max_length=200)
    version = models.PositiveIntegerField(default=1)
    is_reference = models.BooleanField(default=False)
    effective_from = models.DateTimeField()
    currency = models.CharField(max_length=3, default="USD")
    notes = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["slug", "version"], name="uniq_pricebook_slug_version")
        ]
        ordering = ["slug", "-version"]

    def __str__(self) -> str:
        return f"{self.slug} v{self.version}"


class PriceRate(models.Model):
    """One row of a price book: per capacity type, money per vCPU-hour and GiB-hour and a
    per-sandbox startup fee."""

    price_book = models.ForeignKey(PriceBook, on_delete=models.CASCADE, related_name="rates")
    capacity_type = models.CharField(
        max_length=16, choices=CapacityType.choices, default=CapacityType.ON_DEMAND
    )
    vcpu_hour = models.DecimalField(max_digits=20, decimal_places=12)
    gib_hour = models.DecimalField(max_digits=20, decimal_places=12)
    startup_fee = models.DecimalField(max_digits=20, decimal_places=12, default=0)
    # stored state (snapshots, paused sandboxes' pauses): money per GiB-hour of bytes kept
    storage_gib_hour = models.DecimalField(max_digits=20, decimal_places=12, default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["price_book", "capacity_type"], name="uniq_pricerate_book_capacity"
            )
        ]

    def __str__(self) -> str:
        return f"{self.price_book} {self.capacity_type}"


class UsageRecord(models.Model):
    """The usage ledger: one row per sandbox that held resources, written from the
    lifecycle ledger (opened on → provisioning, closed on → deleted/failed/lost).

    The price is captured when the record opens, so later price-book versions never
    reprice past usage. Cost is linear in time, so the cost inside any window is
    ``overlap_hours × hourly_rate`` (+ the startup fee if it started in the window).
    """

    sandbox = models.OneToOneField(
        "sandboxes.Sandbox", on_delete=models.PROTECT, related_name="usage"
    )
    # Indexed by ``usage_tenant_started`` (tenant first), not on its own.
    tenant = models.ForeignKey(
        Tenant, on_delete=models.PROTECT, related_name="usage_records", db_index=False
    )
    image = models.CharField(max_length=200)
    backend = models.CharField(max_length=32)
    node = models.CharField(max_length=128, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    capacity_type = models.CharField(
        max_length=16, choices=CapacityType.choices, default=CapacityType.ON_DEMAND
    )
    cpu_millis = models.PositiveIntegerField()
    memory_mib = models.PositiveIntegerField()
    started_at = models.DateTimeField(db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True, db_index=True)
    end_state = models.CharField(max_length=16, blank=True)
    end_reason = models.CharField(max_length=64, blank=True)
    price_book = models.ForeignKey(PriceBook, on_delete=models.PROTECT, related_name="+")
    hourly_rate = models.DecimalField(max_digits=24, decimal_places=12)
    startup_fee = models.DecimalField(max_digits=20, decimal_places=12)
    # Intervals without compute (a paused sandbox: docs/snapshots.md), ``[[start, end]]``
    # as ISO datetimes, ``end`` null while paused (then the record's end, or now). Not
    # billed at ``hourly_rate``; the pause's state is billed as storage (StorageRecord).
    pauses = models.JSONField(default=list, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "started_at"], name="usage_tenant_started"),
            # the few records with pauses, which the report reads on their own: without
            # it, finding them read every record overlapping the window's open part
            # (every live one)
            models.Index(
                fields=["tenant", "started_at"],
                name="usage_paused",
                condition=~models.Q(pauses=[]),
            ),
        ]

    def __str__(self) -> str:
        return f"usage of {self.sandbox_id}"


class StorageRecord(models.Model):
    """The storage ledger: one row per snapshot that was captured (a client's snapshot or
    the state a paused sandbox keeps), from its capture to its deletion, priced per
    GiB-hour by the book in force at the capture (never repriced).

    cost inside a window = overlap_hours × size GiB × ``gib_hour``.
    """

    snapshot = models.OneToOneField(
        "sandboxes.Snapshot", on_delete=models.PROTECT, related_name="storage"
    )
    tenant = models.ForeignKey(
        Tenant, on_delete=models.PROTECT, related_name="storage_records", db_index=False
    )
    sandbox_id = models.UUIDField()  # the snapshot's sandbox (a pause bills its sandbox)
    kind = models.CharField(max_length=16)  # the snapshot's: "snapshot" | "pause"
    size_bytes = models.BigIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    price_book = models.ForeignKey(PriceBook, on_delete=models.PROTECT, related_name="+")
    gib_hour = models.DecimalField(max_digits=20, decimal_places=12)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "started_at"], name="storage_tenant_started"),
            models.Index(fields=["sandbox_id"], name="storage_sandbox"),
        ]

    def __str__(self) -> str:
        return f"storage of {self.snapshot_id}"


class DailyUsage(models.Model):
    """Roll-up per tenant and UTC day, sliced by ``dimension`` (``total``, ``image`` or
    ``label``) and ``value`` (the image name or ``key=value``). Rebuilt idempotently."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="daily_usage")
    day = models.DateField()
    dimension = models.CharField(max_length=16)
    value = models.CharField(max_length=300, blank=True)
    sandboxes = models.PositiveIntegerField(default=0)
    sandbox_seconds = models.DecimalField(max_digits=20, decimal_places=3, default=0)
    vcpu_seconds = models.DecimalField(max_digits=24, decimal_places=3, default=0)
    gib_seconds = models.DecimalField(max_digits=24, decimal_places=3, default=0)
    cost = models.DecimalField(max_digits=20, decimal_places=10, default=0)
    computed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "day", "dimension", "value"], name="uniq_dailyusage_slice"
            )
        ]
        indexes = [models.Index(fields=["day"], name="dailyusage_day")]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.day} {self.dimension}={self.value}"


class DailyUsageDay(models.Model):
    """Whether a UTC day's ``DailyUsage`` rows are final, so a report may read them
    instead of the records. A day is final when its rows were computed after it ended
    (no live accrual left in them) and no record of it changed since: a late write to
    the ledger (a record opened or closed by the repair sweep, a pause moved) for a time
    before today marks the days from then to yesterday ``stale`` and bumps ``version``;
    the roll-up task rebuilds stale days, and a rebuild clears ``stale`` only when
    ``version`` did not move while it read the records (``daily_usage_rebuild``)."""

    day = models.DateField(unique=True)
    computed_at = models.DateTimeField(null=True, blank=True)
    stale = models.BooleanField(default=False)
    version = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"roll-up of {self.day}"


class BudgetNoticeKind(models.TextChoices):
    ALERT = "alert"  # the owners' spending alert (``budget_alert``)
    TEAM_BUDGET = "team_budget"  # the owners' hard cap
    MONTHLY_BUDGET = "monthly_budget"  # staff's hard cap


class BudgetNotice(models.Model):
    """One crossing of a team's alert or budget in one UTC month: written once (the
    unique constraint is the "once"), with the activity entry in the same transaction;
    the dashboard's banner reads this month's rows; a set webhook is POSTed once."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budget_notices")
    kind = models.CharField(max_length=16, choices=BudgetNoticeKind.choices)
    period = models.CharField(max_length=7)  # "2026-12"
    threshold = models.DecimalField(max_digits=14, decimal_places=2)
    spent = models.DecimalField(max_digits=14, decimal_places=2)
    at = models.DateTimeField(default=timezone.now)
    # The webhook delivery: "" (none set), "pending", "delivered 204", "failed: <why>".
    webhook = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "kind", "period"], name="uniq_budgetnotice_period"
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.kind} {self.period}"
