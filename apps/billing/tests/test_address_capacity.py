"""Past the instance's addresses a create waits in the admission queue (issue 17 goal 2).

The local backend gives every live sandbox one address of the instance's subnet; past
the last one a provision could only fail. Admission counts the subnet as a cluster cap,
so the create that would need one more address is answered ``queued`` (position,
Retry-After) and admitted when a sandbox ends.
"""

from __future__ import annotations

import pytest
from django.test import override_settings
from django.utils import timezone

from apps.core.errors import ApiError
from apps.sandboxes.admission.queue import admission_queue_drain
from apps.sandboxes.backends import address_capacity
from apps.sandboxes.models import LIVE_STATES, Sandbox, SandboxEvent, State, WarmMember
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_transition

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit enqueues must run

# A /29: 8 addresses less the network, the bridge's and the broadcast one = 5 sandboxes.
# A /30 holds one.
TINY = "10.254.254.0/30"
# An instance that has claimed no subnet yet (the settings say which it will claim);
# the test instance's own claimed subnet, a file in its state dir, would win.
FRESH = "admit-unclaimed"


def _create(tenant, name, queue=None):
    sandbox, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(
            image="host", cpu_millis=500, memory_mib=256, external_id=name, queue=queue
        ),
        idempotency_key=None,
        actor="key:test",
    )
    return sandbox


def test_the_subnet_sets_the_capacity(tmp_path):
    fresh = {"STATE_DIR": str(tmp_path), "HEDGEROW_INSTANCE": FRESH}
    with override_settings(**fresh, HEDGEROW_LOCAL_SUBNET="", HEDGEROW_LOCAL_SUBNET_PREFIX=21):
        assert address_capacity() == 2045  # make up's /21
        # An instance keeps the subnet it claimed first: a /22 from before the /21.
        claimed = tmp_path / "sandboxes" / FRESH / "subnet"
        claimed.parent.mkdir(parents=True)
        claimed.write_text("10.213.4.0/22\n")
        assert address_capacity() == 1021
        claimed.unlink()
    with override_settings(**fresh, HEDGEROW_LOCAL_SUBNET="10.254.254.0/29"):
        assert address_capacity() == 5
    with override_settings(**fresh, HEDGEROW_LOCAL_SUBNET=TINY):
        assert address_capacity() == 1
    with override_settings(HEDGEROW_BACKEND="kubernetes"):
        assert address_capacity() is None


@override_settings(
    HEDGEROW_LOCAL_SUBNET=TINY, HEDGEROW_MAX_LIVE_SANDBOXES=0, HEDGEROW_INSTANCE=FRESH
)
def test_a_create_past_the_last_address_queues_and_starts_when_one_ends(
    make_tenant, api_client, no_enqueue
):
    a, secret = make_tenant()
    b, _ = make_tenant()
    http = api_client(secret)
    first = http.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert first.status_code == 201 and first.json()["state"] == "requested"
    # Another team, same instance: the addresses are the installation's, not a team's.
    second = _create(b, "b-second")
    assert second.state == State.QUEUED
    third = http.post("/api/v1/sandboxes", {"image": "host"}, format="json")
    assert third.status_code == 201, third.content
    assert (third.json()["state"], third.json()["queue_position"]) == ("queued", 2)
    assert int(third["Retry-After"]) >= 1
    # Asked not to wait: refused with the limit named, nothing recorded.
    refused = http.post("/api/v1/sandboxes", {"image": "host", "queue": False}, format="json")
    assert refused.status_code == 429 and refused["Retry-After"]
    error = refused.json()["error"]
    assert (error["limit"], error["value"], error["current"]) == ("cluster_addresses", 1, 1)
    assert Sandbox.objects.count() == 3
    assert len(no_enqueue["provision"]) == 1  # only the first holds an address

    assert admission_queue_drain() == 0  # nothing ended: still full
    running = Sandbox.objects.get(external_id=first.json()["id"])
    assert sandbox_transition(
        sandbox=running,
        from_states=(State.REQUESTED,),
        to_state=State.DELETED,
        reason="destroyed",
        terminated_at=timezone.now(),
    )
    assert no_enqueue["drain"], "a sandbox's end must trigger a drain after commit"
    assert admission_queue_drain() == 1  # the freed address goes to the first in line
    assert Sandbox.objects.get(pk=second.pk).state == State.REQUESTED
    assert Sandbox.objects.get(external_id=third.json()["id"]).state == State.QUEUED
    assert len(no_enqueue["provision"]) == 2
    assert SandboxEvent.objects.filter(sandbox=second, reason="admitted").count() == 1
    assert Sandbox.objects.filter(state__in=LIVE_STATES).count() == 1


@override_settings(
    HEDGEROW_LOCAL_SUBNET="10.254.254.0/29", HEDGEROW_MAX_LIVE_SANDBOXES=0, HEDGEROW_INSTANCE=FRESH
)
def test_warm_pool_members_hold_addresses_too(make_tenant, no_enqueue):
    tenant, _ = make_tenant()
    for _ in range(3):
        WarmMember.objects.create(
            backend="local", image="other", cpu_millis=250, memory_mib=128, generation=1
        )
    admitted = [_create(tenant, f"s{i}").state for i in range(3)]
    assert admitted == [State.REQUESTED, State.REQUESTED, State.QUEUED]  # 3 + 2 = 5
    with pytest.raises(ApiError) as full:
        _create(tenant, "s3", queue=False)
    assert full.value.extra == {"limit": "cluster_addresses", "value": 5, "current": 5}


@override_settings(
    HEDGEROW_LOCAL_SUBNET="10.254.254.0/29",
    HEDGEROW_MAX_LIVE_SANDBOXES=0,
    HEDGEROW_INSTANCE=FRESH,
    HEDGEROW_WARM_POOL="host:250m:128Mi:none=8",
    HEDGEROW_WARM_POOL_MAX_WARMING=8,
)
def test_the_warm_pool_fills_only_the_addresses_no_create_needs(make_tenant, no_enqueue):
    from apps.sandboxes.services import warm_pool

    tenant, _ = make_tenant()
    live = [_create(tenant, f"s{i}") for i in range(2)]
    assert [s.state for s in live] == [State.REQUESTED, State.REQUESTED]
    started: list[str] = []
    # 5 addresses, 2 sandboxes: room for 3 members of the target's 8
    assert warm_pool.warm_pool_refill(enqueue=started.append) == {"host:250m:128Mi:none": 3}
    assert WarmMember.objects.count() == 3 == len(started)
    # full: a create waits in the queue, and the pool takes nothing it waits for
    waiting = _create(tenant, "s2")
    assert waiting.state == State.QUEUED
    assert sandbox_transition(
        sandbox=live[0],
        from_states=(State.REQUESTED,),
        to_state=State.DELETED,
        reason="destroyed",
        terminated_at=timezone.now(),
    )
    # the freed address is the queued create's, not a new member's
    assert warm_pool.warm_pool_refill(enqueue=started.append) == {}
    assert WarmMember.objects.count() == 3
    admission_queue_drain()
    waiting.refresh_from_db()
    assert waiting.state == State.REQUESTED
