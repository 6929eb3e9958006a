"""Cost of the sandbox time an episode used.

This is an adapter: the billing area owns prices (versioned price books). Until its
cost function lands, ``sandbox_window_cost`` computes the architecture's formula with
the reference prices below; switching means replacing only this module's body.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from apps.sandboxes.models import Sandbox

# Reference on-demand prices (USD), the same shape as a price-book row.
PRICE_VCPU_HOUR = Decimal("0.0400")
PRICE_GIB_HOUR = Decimal("0.0050")
STARTUP_FEE = Decimal("0")
QUANTUM = Decimal("0.000001")


def sandbox_window_cost(*, sandbox: Sandbox, start: datetime, end: datetime) -> Decimal:
    """``hours × (vcpu × price_vcpu_hour + GiB × price_gib_hour)`` for the part of
    [start, end] the sandbox existed (created → terminated, or still running)."""
    lo = max(start, sandbox.created_at)
    hi = min(end, sandbox.terminated_at) if sandbox.terminated_at else end
    if hi <= lo:
        return Decimal("0")
    hours = Decimal(str((hi - lo).total_seconds())) / Decimal(3600)
    vcpu = Decimal(sandbox.cpu_millis) / Decimal(1000)
    gib = Decimal(sandbox.memory_mib) / Decimal(1024)
    cost = hours * (vcpu * PRICE_VCPU_HOUR + gib * PRICE_GIB_HOUR) + STARTUP_FEE
    return cost.quantize(QUANTUM)
