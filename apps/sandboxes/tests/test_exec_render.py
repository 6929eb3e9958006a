"""The exec hot path's shared renderer gives exactly what OperationSerializer gives."""

from __future__ import annotations

from django.utils import timezone

from apps.sandboxes.api.serializers import OperationSerializer
from apps.sandboxes.api.views import _render_operation
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.tests.factories import make_sandbox


def test_it_renders_operations_exactly_like_the_serializer(db, make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    running = Operation.objects.create(
        tenant=tenant, sandbox=sandbox, operation_id="op-a", generation=1, request_hash="x"
    )
    finished = Operation.objects.create(
        tenant=tenant,
        sandbox=sandbox,
        operation_id="op-b",
        generation=1,
        request_hash="y",
        status=OperationStatus.COMPLETED,
        termination="timeout",
        exit_code=None,
        signal=9,
        stdout={"head": "a", "tail": "z", "encoding": "utf-8", "total_bytes": 9, "truncated": True},
        stderr={"head": "", "tail": "", "encoding": "utf-8", "total_bytes": 0},
        usage={"wall_s": 1.5},
        finished_at=timezone.now(),
    )
    for operation in (running, finished, running):
        assert _render_operation(operation) == OperationSerializer(operation).data
    assert _render_operation(finished)["timed_out"] is True
    assert _render_operation(running)["id"] == "op-a"


def test_it_renders_sandboxes_exactly_like_the_serializer(db, make_tenant):
    from apps.sandboxes.api.serializers import SandboxSerializer
    from apps.sandboxes.api.views import _render_sandbox
    from apps.sandboxes.models import State
    from apps.sandboxes.services import lifecycle

    tenant, _ = make_tenant()
    queued = make_sandbox(tenant, state=State.QUEUED, generation=0)
    requested = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    billed = make_sandbox(tenant, state=State.REQUESTED, generation=0, labels={"a": "b"})
    # Opens its usage record and closes it (a live one accrues between two renders).
    for to_state in (State.PROVISIONING, State.READY, State.TERMINATING, State.DELETED):
        assert lifecycle.sandbox_transition(
            sandbox=billed, from_states=(billed.state,), to_state=to_state, reason="t"
        )
    billed.refresh_from_db()
    for sandbox in (queued, requested, billed, queued):
        rendered = _render_sandbox(sandbox)
        assert rendered == SandboxSerializer(sandbox).data
        assert not hasattr(sandbox, "_hedgerow_render_billing")
    assert _render_sandbox(queued)["queue_position"] == 1
    assert _render_sandbox(billed)["cost"] is not None
    assert _render_sandbox(requested)["cost"] is None
