"""Bad input at the edge is a typed 4xx in the endpoint's error shape, never a 500
(issue 14, finding 13): NUL in query parameters and URL ids, lone surrogates and
deep nesting in JSON bodies, integers past their column. One table, every endpoint
family; the checks live in apps/core/inputs.py and the middleware."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from apps.sandboxes.models import Sandbox
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode, Step

pytestmark = pytest.mark.django_db

DEEP = "[" * 50_000 + "]" * 50_000
DEEP_65 = "[" * 65 + "]" * 65  # one past MAX_JSON_DEPTH: refused without any recursion


def _api_error(response: Any, status: int, code: str, field: str | None = None) -> None:
    assert response.status_code == status, response.content[:300]
    error = response.json()["error"]
    assert set(error) >= {"code", "message", "field"}, error
    assert error["code"] == code, error
    if field is not None:
        assert error["field"] == field, error


def _orchard_error(response: Any, status: int, code: str) -> None:
    assert response.status_code == status, response.content[:300]
    body = response.json()
    assert body["code"] == code and isinstance(body["detail"], str), body


@pytest.fixture
def web(make_tenant):
    """A client that answers errors as the server does (no re-raised exceptions)."""
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, external_id="sb-1")
    Episode.objects.create(tenant=tenant, episode_id="ep-1", task_id="t")
    client = Client(raise_request_exception=False)
    return client, secret, tenant, sandbox


GETS = [
    ("/api/v1/sandboxes?state=a%00b", "state"),
    ("/api/v1/sandboxes?image=a%00b", "image"),
    ("/api/v1/episodes?label=a%00b", "label"),
    ("/api/v1/episodes?task_id=x&%00=1", "\\0"),
    ("/api/v1/sandboxes/a%00b", "path"),
    ("/api/v1/episodes/a%00b", "path"),
    ("/api/v1/sandboxes/sb-1/files?path=/workspace/a%00b", "path"),
]


@pytest.mark.parametrize(("url", "field"), GETS)
def test_a_nul_in_a_query_parameter_or_an_id_is_a_typed_400(web, url, field):
    client, secret, _, _ = web
    response = client.get(url, HTTP_AUTHORIZATION=f"Bearer {secret}")
    _api_error(response, 400, "invalid_text", field)


def test_a_nul_under_orchard_is_a_typed_400_in_its_shape(web):
    client, secret, _, _ = web
    _orchard_error(
        client.get("/orchard/sandboxes/a%00b", HTTP_X_API_KEY=secret), 400, "invalid_text"
    )
    _orchard_error(
        client.get("/orchard/sandboxes/sb-1/files/list?path=%00", HTTP_X_API_KEY=secret),
        400,
        "invalid_text",
    )


BODIES = [
    # (url, body, code, field)
    ("/api/v1/sandboxes", DEEP, "json_too_deep", None),
    ("/api/v1/sandboxes", '{"image": "host", "labels": ' + DEEP_65 + "}", "json_too_deep", None),
    ("/api/v1/episodes", '{"task_id": "t", "sampling": ' + DEEP + "}", "json_too_deep", None),
    ("/api/v1/sandboxes/sb-1/exec", '{"command": ' + DEEP + "}", "json_too_deep", None),
    ("/api/v1/sandboxes/sb-1/exec", '{"command": "echo \\ud800"}', "invalid_text", "command"),
    ("/api/v1/sandboxes/sb-1/exec", '{"command": ["echo", "\\udfff"]}', "invalid_text", None),
    (
        "/api/v1/sandboxes/sb-1/exec",
        '{"command": "env", "env": {"K\\ud800": "v"}}',
        "invalid_text",
        "env.K\ufffd",
    ),
    (
        "/api/v1/episodes/ep-1/steps",
        '{"steps": [{"kind": "exec", "action": {"a": "\\ud800"}}]}',
        "invalid_text",
        None,
    ),
]


@pytest.mark.parametrize(("url", "body", "code", "field"), BODIES)
def test_bad_json_bodies_are_typed_400s(web, url, body, code, field):
    client, secret, tenant, _ = web
    before = (Sandbox.objects.count(), Episode.objects.count(), Step.objects.count())
    response = client.post(
        url, data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}"
    )
    _api_error(response, 400, code, field)
    after = (Sandbox.objects.count(), Episode.objects.count(), Step.objects.count())
    assert after == before


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/orchard/sandboxes", DEEP),
        ("/orchard/sandboxes/sb-1/exec", '{"command": ' + DEEP + "}"),
    ],
)
def test_deep_json_under_orchard_is_a_typed_400(web, url, body):
    client, secret, _, _ = web
    response = client.post(url, data=body, content_type="application/json", HTTP_X_API_KEY=secret)
    _orchard_error(response, 400, "json_too_deep")


def test_a_surrogate_in_an_orchard_exec_is_a_typed_400(web):
    client, secret, _, _ = web
    response = client.post(
        "/orchard/sandboxes/sb-1/exec",
        data='{"command": "echo \\ud800"}',
        content_type="application/json",
        HTTP_X_API_KEY=secret,
    )
    _orchard_error(response, 400, "invalid_text")


@pytest.mark.parametrize(
    ("url", "body", "field"),
    [
        ("/api/v1/episodes/ep-1/steps", {"steps": [{"kind": "exec", "index": 2**62}]}, "steps"),
        ("/api/v1/sandboxes", {"image": "host", "heartbeat_timeout_s": 2**62}, None),
        ("/api/v1/episodes/ep-1/sandboxes", {"sandbox_id": "sb-1", "generation": 2**62}, None),
    ],
)
def test_integers_past_their_column_are_validation_errors(web, url, body, field):
    client, secret, _, _ = web
    steps = Step.objects.count()
    response = client.post(
        url,
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    _api_error(response, 400, "validation_error")
    assert response.json()["error"]["reason"] == "max_value"
    assert Step.objects.count() == steps


def test_an_import_line_nested_too_deep_is_reported_on_its_line(web):
    client, secret, _, _ = web
    lines = DEEP + "\n" + '{"x": "\\ud800"}\n'
    response = client.post(
        "/api/v1/episodes/import",
        data=lines,
        content_type="application/x-ndjson",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert response.status_code == 207, response.content[:300]  # some lines failed
    errors = response.json()["errors"]
    assert [e["line"] for e in errors] == [1, 2]
    assert "deeper than 64" in errors[0]["message"]
    assert "surrogate" in errors[1]["message"] and errors[1]["field"] == "x"
