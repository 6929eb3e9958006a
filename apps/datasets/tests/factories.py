from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from apps.tenancy.models import Tenant
from apps.trajectories.models import Episode

_n = {"i": 0}


def closed_episode(
    tenant: Tenant, task_id: str, cls: str, *, started_at: datetime | None = None, **fields: Any
) -> Episode:
    """A closed episode with a class, as attribution leaves it (saved: the signal counts it)."""
    _n["i"] += 1
    start = started_at or timezone.now() - timedelta(minutes=10)
    return Episode.objects.create(
        tenant=tenant,
        episode_id=fields.pop("episode_id", f"ep-test-{_n['i']:05d}"),
        task_id=task_id,
        status="closed",
        started_at=start,
        ended_at=fields.pop("ended_at", start + timedelta(seconds=5)),
        auto_failure_class=cls,
        failure_class=cls,
        **fields,
    )
