"""Bad input gets a typed 4xx error and leaves nothing behind."""

from __future__ import annotations

import pytest

from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def _assert_error(response, status: int, code: str, field: str | None = None):
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["code"] == code, error
    if field is not None:
        assert error["field"] == field, error
    return error


def test_it_rejects_malformed_json(make_tenant, client):
    _, secret = make_tenant()
    response = client.post(
        "/api/v1/sandboxes",
        data="{not json",
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    _assert_error(response, 400, "malformed_request")
    assert not Sandbox.objects.exists()


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"image": "host", "cpu": "lots"}, "cpu", "invalid_quantity"),
        ({"image": "host", "cpu": "-1"}, "cpu", "invalid_quantity"),
        ({"image": "host", "cpu": 1000}, "cpu", "too_large"),
        ({"image": "host", "memory": "12Qi"}, "memory", "invalid_quantity"),
        ({"image": "host", "memory": "1Ki"}, "memory", "invalid_quantity"),
        ({"image": "host", "sandbox_id": "Bad_ID"}, "sandbox_id", "invalid_sandbox_id"),
        ({"image": "host", "sandbox_id": "all"}, "sandbox_id", "invalid_sandbox_id"),
        ({"image": "host", "sandbox_id": "-x"}, "sandbox_id", "invalid_sandbox_id"),
        ({"image": "host", "ttl_seconds": 10**9}, "ttl_seconds", "too_large"),
        ({"image": "host", "labels": {"bad key!": "x"}}, "labels", "validation_error"),
    ],
)
def test_it_rejects_bad_create_input_with_a_typed_error(
    make_tenant, api_client, body, field, reason
):
    _, secret = make_tenant()
    response = api_client(secret).post("/api/v1/sandboxes", body, format="json")
    error = _assert_error(response, 400, "validation_error", field)
    assert error["reason"] == reason
    assert not Sandbox.objects.exists()
    assert not SandboxEvent.objects.exists()


def test_it_accepts_kubernetes_quantities(
    make_tenant, api_client, django_capture_on_commit_callbacks
):
    _, secret = make_tenant()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api_client(secret).post(
            "/api/v1/sandboxes", {"image": "host", "cpu": "500m", "memory": "2Gi"}, format="json"
        )
    assert response.status_code == 201, response.content
    sandbox = Sandbox.objects.get()
    assert (sandbox.cpu_millis, sandbox.memory_mib, sandbox.state) == (500, 2048, State.REQUESTED)
    assert response.json()["isolation"] == ""
    # provisioning is enqueued only after commit
    assert len(callbacks) >= 1


def test_it_refuses_a_duplicate_sandbox_id(make_tenant, api_client):
    tenant, secret = make_tenant()
    make_sandbox(tenant, external_id="taken")
    response = api_client(secret).post(
        "/api/v1/sandboxes", {"image": "host", "sandbox_id": "taken"}, format="json"
    )
    _assert_error(response, 409, "sandbox_exists", "sandbox_id")
    assert Sandbox.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({}, "validation_error", "command"),
        ({"command": ""}, "validation_error", "command"),
        ({"command": [1, 2]}, "validation_error", "command"),
        ({"command": "ls", "cwd": "relative/dir"}, "validation_error", "cwd"),
        ({"command": "ls", "stdin": "***"}, "validation_error", "stdin"),
        (
            {"command": "ls", "operation_id": "bad id with spaces"},
            "validation_error",
            "operation_id",
        ),
        ({"command": "ls", "timeout": -1}, "validation_error", "timeout"),
    ],
)
def test_it_rejects_bad_exec_input(make_tenant, api_client, body, code, field):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant)
    response = api_client(secret).post(
        f"/api/v1/sandboxes/{sandbox.external_id}/exec", body, format="json"
    )
    _assert_error(response, 400, code, field)


@pytest.mark.parametrize(
    "state", [State.PROVISIONING, State.TERMINATING, State.DELETED, State.LOST]
)
def test_it_refuses_exec_unless_ready(make_tenant, api_client, state):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, state=state)
    response = api_client(secret).post(
        f"/api/v1/sandboxes/{sandbox.external_id}/exec", {"command": "true"}, format="json"
    )
    error = _assert_error(
        response, 409, "sandbox_not_ready" if state == State.PROVISIONING else f"sandbox_{state}"
    )
    assert error["state"] == state


def test_it_refuses_relative_paths_and_oversized_uploads(make_tenant, api_client, settings):
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant)
    api = api_client(secret)
    relative = api.get(f"/api/v1/sandboxes/{sandbox.external_id}/files?path=etc/passwd")
    _assert_error(relative, 400, "path_not_absolute", "path")
    settings.HEDGEROW_MAX_UPLOAD_BYTES = 10
    big = api.put(
        f"/api/v1/sandboxes/{sandbox.external_id}/files?path=/workspace/big",
        data=b"x" * 11,
        content_type="application/octet-stream",
    )
    error = _assert_error(big, 413, "too_large")
    # Quota errors name the limit, its value and the current use (docs/billing.md).
    assert (error["limit"], error["value"], error["current"]) == ("max_upload_bytes", 10, 11)


def test_it_documents_the_error_envelope_in_the_openapi_schema(make_tenant, client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    create = schema["paths"]["/api/v1/sandboxes"]["post"]["responses"]
    assert "409" in create and "400" in create
    assert "Error" in schema["components"]["schemas"]
