"""A sandbox's lifetime can be changed after create, and a deleted sandbox is a
``SandboxDeleted`` (distinct from ``SandboxLost``) carrying why it ended (issue 26,
what the field's SDKs have)."""

from __future__ import annotations

from datetime import datetime

import httpx
import pytest
from hedgerow import Client, SandboxDeleted, SandboxLost, SandboxNotReady, ValidationError

from apps.orchard.tests.live import wait_all_deleted

pytestmark = pytest.mark.timeout(240)


def test_it_sets_a_sandboxs_remaining_lifetime(live, make_tenant):
    tenant, secret = make_tenant()
    _, outsider = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox(ttl_seconds=600) as sandbox:
        before = datetime.fromisoformat(sandbox.data["expires_at"])
        sandbox.set_timeout(7200)
        after = datetime.fromisoformat(sandbox.data["expires_at"])
        assert 7000 < (after - before).total_seconds() + 600 < 7400
        assert datetime.fromisoformat(hr.get(sandbox.id).data["expires_at"]) == after
        with pytest.raises(ValidationError) as bad:
            sandbox.set_timeout(-5)
        assert bad.value.field == "timeout"
        foreign = httpx.post(
            f"{live.url}/api/v1/sandboxes/{sandbox.id}/timeout",
            json={"timeout": 1},
            headers={"Authorization": f"Bearer {outsider}"},
        )
        assert foreign.status_code == 404
        assert datetime.fromisoformat(hr.get(sandbox.id).data["expires_at"]) == after


def test_it_tells_a_deleted_sandbox_from_a_lost_one_with_the_reason(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr:
        sandbox = hr.create_sandbox()
        sandbox.delete()
        wait_all_deleted(tenant)
        with pytest.raises(SandboxDeleted) as gone:
            sandbox.exec("true")
        assert isinstance(gone.value, SandboxNotReady) and not isinstance(gone.value, SandboxLost)
        assert gone.value.code == "sandbox_deleted" and gone.value.reason == "deleted"
        with pytest.raises(SandboxDeleted):
            sandbox.set_timeout(60)
