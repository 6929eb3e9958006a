"""Cost of the sandbox time an episode used: the billing area's priced usage records
(versioned price books, startup fee when the sandbox started inside the window)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from apps.billing.usage import sandbox_window_cost as billed_window_cost
from apps.sandboxes.models import Sandbox

QUANTUM = Decimal("0.000001")


def sandbox_window_cost(*, sandbox: Sandbox, start: datetime, end: datetime) -> Decimal:
    """Cost of ``sandbox`` inside [start, end), rounded to micro-dollars."""
    return billed_window_cost(sandbox=sandbox, start=start, end=end).quantize(QUANTUM)
