"""The team activity log entry a sandbox deletion writes (once, naming who did it)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.sandboxes.models import Sandbox, State
from apps.tenancy.models import Activity, ApiKey

pytestmark = pytest.mark.django_db


def test_deleting_a_sandbox_is_logged_once(make_tenant, api_client):
    tenant, secret = make_tenant()
    key = ApiKey.objects.get(tenant=tenant)
    now = timezone.now()
    Sandbox.objects.create(
        tenant=tenant,
        external_id="sb-logged",
        state=State.READY,
        generation=1,
        image="host",
        cpu_millis=1000,
        memory_mib=1024,
        ttl_seconds=600,
        expires_at=now + timedelta(minutes=10),
        backend="local",
    )
    http = api_client(secret)
    assert http.delete("/api/v1/sandboxes/sb-logged").status_code in (200, 202)
    assert http.delete("/api/v1/sandboxes/sb-logged").status_code in (200, 202)
    entries = list(Activity.objects.filter(tenant=tenant, action="sandbox.deleted"))
    assert [(e.actor, e.target_id) for e in entries] == [(f"key:{key.prefix}", "sb-logged")]
    assert entries[0].details == {"reason": "deleted", "image": "host"}
