"""Wire contract of /orchard without sandboxes running: auth, errors, ids, create shape."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox


@pytest.fixture
def web() -> Client:
    return Client()


def _call(web: Client, method: str, path: str, key: str | None = None, body=None):
    headers = {"X-API-Key": key} if key else {}
    if method in ("get", "delete"):
        return getattr(web, method)("/orchard" + path, headers=headers)
    data = json.dumps(body) if body is not None else ""
    return getattr(web, method)(
        "/orchard" + path, data=data, content_type="application/json", headers=headers
    )


def test_it_answers_health_without_a_key(web, db):
    response = _call(web, "get", "/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/resources"),
        ("post", "/sandboxes"),
        ("get", "/sandboxes/x"),
        ("delete", "/sandboxes/x"),
        ("get", "/sandboxes/x/wait"),
        ("post", "/sandboxes/x/heartbeat"),
        ("post", "/sandboxes/x/exec"),
        ("post", "/sandboxes/x/apply_patch"),
        ("get", "/sandboxes/x/files"),
        ("post", "/sandboxes/x/files"),
        ("get", "/sandboxes/x/files/list"),
        ("get", "/jobs/x"),
        ("get", "/jobs/x/wait"),
    ],
)
def test_it_refuses_a_missing_key_401_and_an_unknown_key_403(web, db, method, path):
    missing = _call(web, method, path, body={})
    assert missing.status_code == 401
    assert "detail" in missing.json()
    unknown = _call(web, method, path, key="hr_not-a-key", body={})
    assert unknown.status_code == 403
    assert "detail" in unknown.json()


def test_it_refuses_a_read_only_key_for_writes_and_creates_nothing(web, make_tenant):
    _, secret = make_tenant(scopes=["read"])
    response = _call(web, "post", "/sandboxes", secret, {"image": "host"})
    assert response.status_code == 403
    assert Sandbox.objects.count() == 0
    assert _call(web, "get", "/resources", secret).status_code == 200


def test_it_creates_a_pending_sandbox_with_the_orchard_fields(web, make_tenant):
    tenant, secret = make_tenant()
    response = _call(
        web,
        "post",
        "/sandboxes",
        secret,
        {"image": "host", "sandbox_id": "my-env-1", "cpu": "500m", "memory": "1Gi", "timeout": 90},
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["sandbox_id"] == "my-env-1"
    assert body["status"] == "pending"
    assert body["block_network"] is True
    assert body["timeout"] == 90
    assert body["namespace"] == tenant.slug
    sandbox = Sandbox.objects.get(tenant=tenant, external_id="my-env-1")
    assert (sandbox.cpu_millis, sandbox.memory_mib, sandbox.network_access) == (500, 1024, False)
    assert SandboxEvent.objects.filter(sandbox=sandbox, event="created").count() == 1


def test_it_maps_block_network_false_to_network_access(web, make_tenant):
    tenant, secret = make_tenant()
    response = _call(web, "post", "/sandboxes", secret, {"image": "host", "block_network": False})
    assert response.status_code == 200
    sandbox = Sandbox.objects.get(tenant=tenant, external_id=response.json()["sandbox_id"])
    assert sandbox.network_access is True


def test_it_uses_the_default_image_only_when_the_body_names_none(web, make_tenant):
    # an image that cannot be had is a typed 422, never the default in its place
    # (apps/images/tests/test_images_api.py::test_orchard_create_never_falls_back_to_host)
    tenant, secret = make_tenant()
    response = _call(web, "post", "/sandboxes", secret, {})
    assert response.status_code == 200
    assert response.json()["image"] == "host"


@pytest.mark.parametrize("bad_id", ["all", "UPPER", "-x", "a" * 64, "has space"])
def test_it_refuses_invalid_or_reserved_ids(web, make_tenant, bad_id):
    _, secret = make_tenant()
    response = _call(web, "post", "/sandboxes", secret, {"image": "host", "sandbox_id": bad_id})
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_sandbox_id"
    assert Sandbox.objects.count() == 0


def test_it_refuses_a_duplicate_id_in_one_tenant_but_not_across_tenants(web, make_tenant):
    _, first = make_tenant()
    _, second = make_tenant()
    body = {"image": "host", "sandbox_id": "dup"}
    assert _call(web, "post", "/sandboxes", first, body).status_code == 200
    again = _call(web, "post", "/sandboxes", first, body)
    assert again.status_code == 409
    assert again.json()["code"] == "sandbox_exists"
    assert _call(web, "post", "/sandboxes", second, body).status_code == 200
    assert Sandbox.objects.filter(external_id="dup").count() == 2


def test_it_hides_another_tenants_sandbox_and_job(web, make_tenant):
    owner, _ = make_tenant()
    _, outsider = make_tenant()
    sandbox = make_sandbox(owner)
    for method, path in [
        ("get", f"/sandboxes/{sandbox.external_id}"),
        ("delete", f"/sandboxes/{sandbox.external_id}"),
        ("post", f"/sandboxes/{sandbox.external_id}/exec"),
        ("get", f"/sandboxes/{sandbox.external_id}/files/list"),
    ]:
        response = _call(web, method, path, outsider, {"command": "true"})
        assert response.status_code == 404, (method, path)
    sandbox.refresh_from_db()
    assert sandbox.state == State.READY


def test_it_answers_unknown_jobs_and_paths_with_json_404(web, make_tenant):
    _, secret = make_tenant()
    for path in ["/jobs/not-a-uuid", "/jobs/00000000-0000-0000-0000-000000000000", "/nope"]:
        response = _call(web, "get", path, secret)
        assert response.status_code == 404
        assert "detail" in response.json()


def test_it_validates_exec_bodies(web, make_tenant):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant)
    for body in [
        {"command": ""},
        {"command": []},
        {"command": ["ls", 1]},
        {"command": "ls", "cwd": "relative"},
        {"command": "ls", "env": {"A": 1}},
        {"command": "ls", "timeout_seconds": -1},
    ]:
        response = _call(web, "post", f"/sandboxes/{sandbox.external_id}/exec", secret, body)
        assert response.status_code == 400, body
        assert "detail" in response.json()
    assert sandbox.operations.count() == 0


def test_it_summarises_resources_against_the_quota(web, make_tenant):
    tenant, secret = make_tenant()
    make_sandbox(tenant, cpu_millis=1500, memory_mib=2048)
    make_sandbox(tenant, state=State.DELETED, cpu_millis=4000)
    body = _call(web, "get", "/resources", secret).json()
    assert body["requested"]["cpu_millis"] == 1500
    assert body["requested"]["memory_mib"] == 2048
    assert body["requested"]["sandboxes"] == 1
    assert body["available"]["cpu_millis"] == body["capacity"]["cpu_millis"] - 1500
    assert set(body) >= {"capacity", "allocatable", "requested", "available"}


def test_it_reports_a_missing_sandbox_on_wait_as_404(web, make_tenant):
    _, secret = make_tenant()
    response = _call(web, "get", "/sandboxes/ghost/wait?timeout=0", secret)
    assert response.status_code == 404


def test_it_times_out_a_sandbox_wait_with_408_and_reports_failures_as_failed(web, make_tenant):
    tenant, secret = make_tenant()
    pending = make_sandbox(tenant, state=State.REQUESTED)
    waited = _call(web, "get", f"/sandboxes/{pending.external_id}/wait?timeout=0.2", secret)
    assert waited.status_code == 408
    assert "detail" in waited.json()
    failed = make_sandbox(tenant, state=State.FAILED, status_message="image pull failed")
    body = _call(web, "get", f"/sandboxes/{failed.external_id}/wait?timeout=1", secret).json()
    assert (body["status"], body["ready"], body["status_message"]) == (
        "failed",
        False,
        "image pull failed",
    )
