"""E2B's pause and connect-resumes-a-paused-sandbox, driven by the real e2b SDK
(2.63.0) against the live stack (issue 16)."""

from __future__ import annotations

import pytest
from e2b import Sandbox, SandboxException, SandboxQuery, SandboxState

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.e2b.tests.live import opts, wait_all_deleted
from apps.sandboxes.models import Sandbox as Row
from apps.sandboxes.models import Snapshot, State

pytestmark = pytest.mark.timeout(240)


def test_a_filesystem_pause_keeps_the_files_and_connect_resumes_it(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)
    sbx = Sandbox.create(metadata={"run": "p1"}, **o)
    assert sbx.commands.run("echo kept > /workspace/k").exit_code == 0
    row = Row.objects.get(external_id=sbx.sandbox_id)

    # E2B's default pause keeps memory: refused, typed, and the sandbox runs on
    with pytest.raises(SandboxException) as full:
        sbx.beta_pause()
    assert full.value.status_code == 400 and "filesystem" in str(full.value)
    row.refresh_from_db()
    assert row.state == State.READY

    assert sbx.beta_pause(mode="filesystem") is True
    row.refresh_from_db()
    assert row.state == State.PAUSED
    assert row.events.filter(event="compute_released").exists()  # answered once captured
    assert Snapshot.objects.get(sandbox=row, kind="pause").state == "ready"
    assert sbx.get_info().state.value == "paused"
    assert sbx.beta_pause(mode="filesystem") is False  # already paused (E2B's 409)
    # Listed as paused: by default (running and paused, as E2B) and by state.
    running = Sandbox.create(metadata={"run": "p1"}, **o)

    def listed(*states: SandboxState) -> dict[str, str]:
        query = SandboxQuery(metadata={"run": "p1"}, state=list(states) or None)
        return {s.sandbox_id: s.state.value for s in Sandbox.list(query=query, **o).next_items()}

    both = {sbx.sandbox_id: "paused", running.sandbox_id: "running"}
    assert listed() == both
    assert listed(SandboxState.PAUSED) == {sbx.sandbox_id: "paused"}
    assert listed(SandboxState.RUNNING) == {running.sandbox_id: "running"}
    assert listed(SandboxState.RUNNING, SandboxState.PAUSED) == both
    running.kill()

    # another process connects by id: the paused sandbox is resumed from its files
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300, **o)
    assert resumed.sandbox_id == sbx.sandbox_id
    row.refresh_from_db()
    assert (row.state, row.generation) == (State.READY, 2)
    assert resumed.commands.run("cat /workspace/k").stdout == "kept\n"
    assert resumed.get_info().state.value == "running"
    # connecting to it running changes nothing
    assert Sandbox.connect(sbx.sandbox_id, **o).sandbox_id == sbx.sandbox_id
    row.refresh_from_db()
    assert row.generation == 2
    resumed.kill()
    wait_all_deleted(tenant)


def test_a_resume_over_the_limit_is_refused_and_it_stays_paused(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)
    sbx = Sandbox.create(**o)
    assert sbx.beta_pause(mode="filesystem") is True
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=1)
    other = Sandbox.create(**o)  # the paused one holds no compute: this one fits
    with pytest.raises(SandboxException) as refused:
        Sandbox.connect(sbx.sandbox_id, **o)
    assert refused.value.status_code == 429
    assert Row.objects.get(external_id=sbx.sandbox_id).state == State.PAUSED
    other.kill()
    Sandbox.kill(sbx.sandbox_id, **o)  # a paused sandbox can be killed
    wait_all_deleted(tenant)
