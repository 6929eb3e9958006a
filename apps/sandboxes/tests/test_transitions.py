"""Compare-and-set transitions under a race: a move that is still valid is retried,
never silently dropped."""

from __future__ import annotations

import pytest
from django.db.models import QuerySet

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services import lifecycle
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def test_it_still_deletes_when_provisioning_claims_the_row_mid_transition(make_tenant, monkeypatch):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.REQUESTED, generation=0)
    real_update = QuerySet.update
    raced = {"done": False}

    def update_after_a_race(self, **kwargs):
        # Between the delete's read and its update, the provisioner claims the row.
        if self.model is Sandbox and not raced["done"]:
            raced["done"] = True
            real_update(
                Sandbox.objects.filter(pk=sandbox.pk), state=State.PROVISIONING, generation=1
            )
        return real_update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", update_after_a_race)
    moved = lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.REQUESTED, State.PROVISIONING, State.READY),
        to_state=State.TERMINATING,
        reason="deleted",
    )
    assert raced["done"]
    assert moved is True
    sandbox.refresh_from_db()
    assert (sandbox.state, sandbox.generation) == (State.TERMINATING, 1)
    event = SandboxEvent.objects.get(sandbox=sandbox, event="transition")
    assert (event.from_state, event.to_state) == (State.PROVISIONING, State.TERMINATING)


def test_it_gives_up_when_the_race_leaves_the_row_outside_its_from_states(make_tenant, monkeypatch):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.PROVISIONING, generation=1)
    real_update = QuerySet.update

    def update_after_a_race(self, **kwargs):
        if self.model is Sandbox:
            real_update(Sandbox.objects.filter(pk=sandbox.pk), state=State.READY)
        return real_update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", update_after_a_race)
    moved = lifecycle.sandbox_transition(
        sandbox=sandbox,
        from_states=(State.PROVISIONING,),
        to_state=State.FAILED,
        reason="provision_error",
    )
    assert moved is False
    assert sandbox.state == State.READY
    assert not SandboxEvent.objects.filter(sandbox=sandbox).exists()
