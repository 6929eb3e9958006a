"""The E2B control plane, driven by the real e2b SDK against the live stack."""

from __future__ import annotations

import datetime as dt

import pytest
from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
)

from apps.e2b.tests.live import opts, wait_all_deleted
from apps.sandboxes.models import Sandbox as Row
from apps.sandboxes.models import SandboxEvent, State

pytestmark = pytest.mark.timeout(240)


def test_it_creates_gets_lists_times_out_and_kills_through_the_sdk(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)
    sbx = Sandbox.create(metadata={"run": "r1", "user": "ann"}, timeout=120, **o)
    row = Row.objects.get(external_id=sbx.sandbox_id)
    assert (row.tenant_id, row.state, row.image) == (tenant.pk, State.READY, "host")
    assert row.labels == {"run": "r1", "user": "ann"}
    assert row.network_access is False  # omitted: Hedgerow's default
    lifetime = (row.expires_at - row.created_at).total_seconds()
    assert 119 <= lifetime <= 121

    info = sbx.get_info()
    assert (info.sandbox_id, info.template_id, info.metadata) == (
        sbx.sandbox_id,
        "base",
        {"run": "r1", "user": "ann"},
    )
    assert info.state.value == "running" and info.cpu_count == 1 and info.memory_mb == 1024

    other = Sandbox.create(metadata={"run": "r2"}, allow_internet_access=True, **o)
    assert Row.objects.get(external_id=other.sandbox_id).network_access is True
    listed = Sandbox.list(query=SandboxQuery(metadata={"run": "r1"}), **o).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
    everything = {s.sandbox_id for s in Sandbox.list(**o).next_items()}
    assert everything == {sbx.sandbox_id, other.sandbox_id}

    sbx.set_timeout(600)
    row.refresh_from_db()
    left = (row.expires_at - dt.datetime.now(dt.UTC)).total_seconds()
    assert 590 <= left <= 601

    # Connecting to a running sandbox by id (another process would do this).
    again = Sandbox.connect(sbx.sandbox_id, **o)
    assert again.sandbox_id == sbx.sandbox_id

    sbx.kill()
    row.refresh_from_db()
    assert row.state in (State.TERMINATING, State.DELETED)
    assert SandboxEvent.objects.filter(sandbox=row, to_state=State.TERMINATING).exists()
    assert Sandbox.kill(sbx.sandbox_id, **o) is False  # gone: E2B's "not found" answer
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **o)
    assert [s.sandbox_id for s in Sandbox.list(**o).next_items()] == [other.sandbox_id]
    other.kill()
    wait_all_deleted(tenant)


def test_it_switches_by_environment_variables_alone(live, make_tenant, monkeypatch):
    tenant, secret = make_tenant()
    monkeypatch.setenv("E2B_API_URL", live.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", live.url + "/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", secret)
    sbx = Sandbox.create()
    assert Row.objects.get(external_id=sbx.sandbox_id, tenant=tenant).state == State.READY
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_answers_a_foreign_tenant_not_found_on_each_call(live, make_tenant):
    owner, secret = make_tenant()
    _, stranger = make_tenant()
    sbx = Sandbox.create(metadata={"k": "v"}, **opts(live, secret))
    foreign = opts(live, stranger)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **foreign)
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout(sbx.sandbox_id, 5, **foreign)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, **foreign)
    assert Sandbox.kill(sbx.sandbox_id, **foreign) is False
    assert Sandbox.list(query=SandboxQuery(metadata={"k": "v"}), **foreign).next_items() == []
    row = Row.objects.get(external_id=sbx.sandbox_id)
    assert row.state == State.READY  # untouched
    sbx.kill()
    wait_all_deleted(owner)


def test_it_refuses_bad_input_and_keys_with_typed_errors_and_creates_nothing(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)
    with pytest.raises(SandboxException) as unknown:
        Sandbox.create(template="no-such-image", **o)
    assert unknown.value.status_code == 404 and "no-such-image" in str(unknown.value)
    with pytest.raises(SandboxException) as too_long:
        Sandbox.create(timeout=10**9, **o)
    assert too_long.value.status_code == 400 and "timeout" in str(too_long.value)
    with pytest.raises(SandboxException) as env:
        Sandbox.create(envs={"A": "nul\x00"}, **o)
    assert env.value.status_code == 400 and "envVars" in str(env.value)
    with pytest.raises(SandboxException) as bad_label:
        Sandbox.create(metadata={"bad key!": "v"}, **o)
    assert bad_label.value.status_code == 400
    with pytest.raises(AuthenticationException):
        Sandbox.create(**{**o, "api_key": "hr_not_a_key"})
    _, reader = make_tenant(scopes=["read"])
    with pytest.raises(SandboxException) as forbidden:
        Sandbox.create(**opts(live, reader))
    assert forbidden.value.status_code == 403
    assert not Row.objects.filter(tenant=tenant).exists()

    sbx = Sandbox.create(**o)
    with pytest.raises(SandboxException) as paused:
        sbx.pause()  # E2B's default keeps memory, which Hedgerow never captures
    assert paused.value.status_code == 400 and "mode='filesystem'" in str(paused.value)
    assert Row.objects.get(external_id=sbx.sandbox_id).state == State.READY
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_answers_a_retried_create_with_the_same_sandbox(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)
    first = Sandbox.create(idempotency_key="rollout-7", envs={"A": "1"}, **o)
    again = Sandbox.create(idempotency_key="rollout-7", envs={"A": "1"}, **o)
    assert again.sandbox_id == first.sandbox_id
    assert Row.objects.filter(tenant=tenant).count() == 1
    with pytest.raises(SandboxException) as changed:
        Sandbox.create(idempotency_key="rollout-7", envs={"A": "2"}, **o)
    assert changed.value.status_code == 409
    first.kill()
    wait_all_deleted(tenant)


def test_it_pages_sandbox_lists_with_next_tokens_and_filters(live, make_tenant):
    tenant, secret = make_tenant()
    o = opts(live, secret)
    made = [Sandbox.create(metadata={"batch": "p"}, **o) for _ in range(3)]
    extra = Sandbox.create(metadata={"batch": "q"}, **o)
    query = SandboxQuery(metadata={"batch": "p"})

    paginator = Sandbox.list(query=query, limit=2, **o)
    first = paginator.next_items()
    assert paginator.has_next and paginator.next_token
    second = paginator.next_items()
    assert not paginator.has_next
    # Oldest first, each once, across pages.
    assert [s.sandbox_id for s in first + second] == [s.sandbox_id for s in made]

    # A sandbox killed between pages neither repeats nor hides another.
    paginator = Sandbox.list(query=query, limit=1, **o)
    assert [s.sandbox_id for s in paginator.next_items()] == [made[0].sandbox_id]
    made[1].kill()
    assert [s.sandbox_id for s in paginator.next_items()] == [made[2].sandbox_id]
    assert not paginator.has_next

    newest = Sandbox.list(limit=1, order="desc", **o).next_items()
    assert [s.sandbox_id for s in newest] == [extra.sandbox_id]
    templated = Sandbox.list(query=SandboxQuery(template="base"), **o).next_items()
    assert {s.sandbox_id for s in templated} == {
        made[0].sandbox_id,
        made[2].sandbox_id,
        extra.sandbox_id,
    }
    assert Sandbox.list(query=SandboxQuery(template="nope"), **o).next_items() == []
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    assert Sandbox.list(query=SandboxQuery(started_after=later), **o).next_items() == []

    # A token this server did not give is a typed error, not a 5xx.
    forged = Sandbox.list(limit=1, next_token="not-a-token", **o)
    with pytest.raises(SandboxException, match="nextToken"):
        forged.next_items()
    for sandbox in (made[0], made[2], extra):
        sandbox.kill()
    wait_all_deleted(tenant)
