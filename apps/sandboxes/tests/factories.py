from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from apps.sandboxes.models import Sandbox, State
from apps.tenancy.models import Tenant


def make_sandbox(tenant: Tenant, **fields: Any) -> Sandbox:
    now = timezone.now()
    defaults: dict[str, Any] = {
        "external_id": f"sb-{Sandbox.objects.count() + 1:04d}",
        "state": State.READY,
        "generation": 1,
        "image": "host",
        "cpu_millis": 1000,
        "memory_mib": 512,
        "ttl_seconds": 3600,
        "expires_at": now + timedelta(hours=1),
        "backend": "local",
        "endpoint_host": "127.0.0.1",
        "endpoint_port": 9,  # discard port: nothing answers; tenancy must refuse before
    }
    defaults.update(fields)
    return Sandbox.objects.create(tenant=tenant, **defaults)
