"""Security review of /orchard: every endpoint against an outsider's key on objects that
exist (404, nothing changes), read-only keys on every write, Orchard's error shape on
every failure, a 500 included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from apps.sandboxes.models import Operation, OperationStatus, Sandbox, SandboxEvent
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db

SANDBOX_CALLS = [
    ("get", "/sandboxes/{sb}", None),
    ("delete", "/sandboxes/{sb}", None),
    ("get", "/sandboxes/{sb}/wait?timeout=0", None),
    ("post", "/sandboxes/{sb}/heartbeat", None),
    ("post", "/sandboxes/{sb}/exec", {"command": "true"}),
    ("post", "/sandboxes/{sb}/apply_patch", {"patch": "--- a\n+++ b\n"}),
    ("get", "/sandboxes/{sb}/files?path=/etc/hostname", None),
    ("post", "/sandboxes/{sb}/files", {"path": "/workspace/x", "content": "aGk="}),
    ("get", "/sandboxes/{sb}/files/list?path=/workspace", None),
    ("get", "/jobs/{job}", None),
    ("get", "/jobs/{job}/wait?timeout=0", None),
]


def _call(method: str, path: str, key: str, body: Any = None) -> Any:
    web = Client(raise_request_exception=False)
    headers = {"X-API-Key": key}
    if method in ("get", "delete"):
        return getattr(web, method)("/orchard" + path, headers=headers)
    data = json.dumps(body) if body is not None else ""
    return getattr(web, method)(
        "/orchard" + path, data=data, content_type="application/json", headers=headers
    )


def _owned(make_tenant: Any) -> tuple[Sandbox, Operation]:
    owner, _ = make_tenant()
    sandbox = make_sandbox(owner, external_id="sb-owned")
    operation = Operation.objects.create(
        tenant=owner, sandbox=sandbox, operation_id="op-owned", generation=1,
        request={"command": "true"}, request_hash="x", status=OperationStatus.COMPLETED,
        stdout={"text": "owner-output"},
    )  # fmt: skip
    return sandbox, operation


def _state(sandbox: Sandbox) -> tuple[Any, ...]:
    sandbox.refresh_from_db()
    return (
        sandbox.state,
        sandbox.last_heartbeat_at,
        SandboxEvent.objects.count(),
        Operation.objects.count(),
    )


@pytest.mark.parametrize(("method", "path", "body"), SANDBOX_CALLS)
def test_it_answers_an_outsider_404_on_every_endpoint_and_changes_nothing(
    make_tenant, method, path, body
):
    sandbox, operation = _owned(make_tenant)
    outsider_team, outsider = make_tenant()
    before = _state(sandbox)
    response = _call(method, path.format(sb="sb-owned", job=operation.pk), outsider, body)
    assert response.status_code == 404, response.content
    assert set(response.json()) == {"detail", "code"}
    assert b"owner-output" not in response.content
    assert _state(sandbox) == before


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/sandboxes", {"image": "host"}),
        *[(m, p, b) for m, p, b in SANDBOX_CALLS if m != "get"],
    ],
)
def test_it_refuses_every_orchard_write_to_a_read_only_key(make_tenant, method, path, body):
    tenant, _ = make_tenant()
    from apps.tenancy.services import api_key_create

    read_only = api_key_create(tenant=tenant, name="ro", scopes=["read"]).secret
    sandbox = make_sandbox(tenant, external_id="sb-owned")
    before = (_state(sandbox), Sandbox.objects.count())
    response = _call(method, path.format(sb="sb-owned", job="x"), read_only, body)
    assert response.status_code == 403, response.content
    assert response.json()["code"] == "forbidden"
    assert (_state(sandbox), Sandbox.objects.count()) == before


def test_it_counts_only_the_callers_sandboxes_in_resources(make_tenant):
    _owned(make_tenant)
    _, outsider = make_tenant()
    requested = _call("get", "/resources", outsider).json()["requested"]
    assert (requested["sandboxes"], requested["cpu_millis"]) == (0, 0)


def test_it_answers_an_unexpected_failure_in_orchards_shape(make_tenant, monkeypatch):
    from apps.orchard import services

    def boom(**kwargs: Any) -> Any:
        raise RuntimeError("internals: password=hunter2")

    monkeypatch.setattr(services, "orchard_resources", boom)
    _, key = make_tenant()
    response = _call("get", "/resources", key)
    assert response.status_code == 500
    assert response.json() == {"detail": "internal error", "code": "internal_error"}
    assert b"hunter2" not in response.content
