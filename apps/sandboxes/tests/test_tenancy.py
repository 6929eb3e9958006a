"""Another tenant's sandbox is a 404 on every endpoint, and nothing changes."""

from __future__ import annotations

import pytest

from apps.sandboxes.models import Operation, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db

ENDPOINTS = [
    ("get", "/api/v1/sandboxes/{id}", None),
    ("delete", "/api/v1/sandboxes/{id}", None),
    ("get", "/api/v1/sandboxes/{id}/wait?timeout=0", None),
    ("post", "/api/v1/sandboxes/{id}/heartbeat", None),
    ("get", "/api/v1/sandboxes/{id}/events", None),
    ("post", "/api/v1/sandboxes/{id}/exec", {"command": "echo hi"}),
    ("post", "/api/v1/sandboxes/{id}/apply_patch", {"patch": "--- a/x\n+++ b/x\n"}),
    ("get", "/api/v1/sandboxes/{id}/operations", None),
    ("get", "/api/v1/sandboxes/{id}/operations/op-1", None),
    ("get", "/api/v1/sandboxes/{id}/files?path=/etc/hostname", None),
    ("put", "/api/v1/sandboxes/{id}/files?path=/workspace/x", None),
    ("get", "/api/v1/sandboxes/{id}/files/list?path=/workspace", None),
    ("get", "/api/v1/sandboxes/{id}/files/stat?path=/workspace", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_it_answers_404_for_another_tenants_sandbox(make_tenant, api_client, method, path, body):
    owner, _ = make_tenant()
    _, outsider_secret = make_tenant()
    sandbox = make_sandbox(owner)
    events_before = SandboxEvent.objects.count()
    outsider = api_client(outsider_secret)
    response = getattr(outsider, method)(path.format(id=sandbox.external_id), body, format="json")
    assert response.status_code == 404, response.content
    assert response.json()["error"]["code"] == "sandbox_not_found"
    sandbox.refresh_from_db()
    assert sandbox.state == State.READY
    assert SandboxEvent.objects.count() == events_before
    assert not Operation.objects.exists()


def test_it_lists_only_the_callers_sandboxes(make_tenant, api_client):
    owner, owner_secret = make_tenant()
    other, other_secret = make_tenant()
    mine = make_sandbox(owner)
    make_sandbox(other)
    listed = api_client(owner_secret).get("/api/v1/sandboxes").json()
    assert [s["id"] for s in listed["results"]] == [mine.external_id]
    assert listed["count"] == 1


def test_it_lets_two_tenants_use_the_same_sandbox_id(make_tenant, api_client):
    first, first_secret = make_tenant()
    second, second_secret = make_tenant()
    make_sandbox(first, external_id="shared-name")
    theirs = make_sandbox(second, external_id="shared-name", image="other")
    got = api_client(second_secret).get("/api/v1/sandboxes/shared-name").json()
    assert got["image"] == theirs.image


def test_it_never_shows_another_tenants_api_keys(make_tenant, api_client):
    _, first_secret = make_tenant()
    second, second_secret = make_tenant()
    second_key = second.api_keys.get()
    outsider = api_client(first_secret)
    assert outsider.delete(f"/api/v1/keys/{second_key.id}").status_code == 404
    second_key.refresh_from_db()
    assert second_key.revoked_at is None
    assert str(second_key.id) not in str(outsider.get("/api/v1/keys").json())
