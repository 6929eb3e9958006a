"""A sandbox's ``progress`` is the backend's pull events in the contract's shape,
written at most every 0.25 s while it is ``provisioning``, shown only then; the spec
carries the team's registry login."""

from __future__ import annotations

import pytest

from apps.images import services
from apps.images.tests.conftest import push_image
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.provisioning import _ProvisionProgress, sandbox_spec
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def test_pull_events_become_the_sandboxs_progress_while_provisioning(make_tenant, api_client):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, state=State.PROVISIONING)
    writer = _ProvisionProgress(sandbox)
    writer({"phase": "resolved", "digest": "sha256:" + "0" * 64})
    writer({"phase": "fetching", "layers": 3, "bytes": 10, "total": 300})  # < 0.25 s: held
    assert Sandbox.objects.get(pk=sandbox.pk).progress == {
        "phase": "resolved",
        "layers": 0,
        "bytes": 0,
        "total": 0,
    }
    writer.written_at -= 1.0  # as if 1 s had passed since the last write
    writer({"phase": "fetching", "layers": 3, "bytes": 150, "total": 300})
    shown = api_client(secret).get(f"/api/v1/sandboxes/{sandbox.external_id}").json()
    assert shown["progress"] == {"phase": "fetching", "layers": 3, "bytes": 150, "total": 300}
    Sandbox.objects.filter(pk=sandbox.pk).update(state=State.READY)
    shown = api_client(secret).get(f"/api/v1/sandboxes/{sandbox.external_id}").json()
    assert shown["progress"] is None


def test_progress_is_never_written_to_a_sandbox_that_left_provisioning(make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.TERMINATING)
    _ProvisionProgress(sandbox)({"phase": "fetching", "layers": 1, "bytes": 1, "total": 2})
    assert Sandbox.objects.get(pk=sandbox.pk).progress is None


def test_the_spec_carries_the_teams_login_for_the_images_registry(
    make_tenant, registry, tmp_path, unique_repo
):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    ref, _ = push_image(registry, tmp_path, unique_repo("spec"))
    services.credential_create(
        tenant=tenant, registry=registry.host, username=USER, password=PASSWORD
    )
    mine = sandbox_spec(make_sandbox(tenant, image=ref))
    assert mine.registry_credentials is not None
    assert (mine.registry_credentials.username, mine.registry_credentials.password) == (
        USER,
        PASSWORD,
    )
    assert PASSWORD not in repr(mine)
    assert sandbox_spec(make_sandbox(other, image=ref)).registry_credentials is None
    assert sandbox_spec(make_sandbox(tenant, image="host")).registry_credentials is None
