"""The API docs page loads Swagger UI from our own pinned static files, never a CDN."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.staticfiles import finders

pytestmark = pytest.mark.django_db


def test_the_api_docs_page_needs_no_internet(client) -> None:
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "cdn.jsdelivr" not in html and "unpkg" not in html and "@latest" not in html
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets), assets
    assert any(a.endswith(".css") for a in assets), assets
    for asset in assets:
        # every asset the page names is one of our static files (served by whitenoise)
        assert finders.find(asset.removeprefix("/static/")) is not None, asset


def _schema() -> tuple[dict[str, Any], list[str]]:
    from drf_spectacular.drainage import GENERATOR_STATS
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.validation import validate_schema

    GENERATOR_STATS.reset()
    schema = SchemaGenerator().get_schema(request=None, public=True)
    problems = sorted([*GENERATOR_STATS._warn_cache, *GENERATOR_STATS._error_cache])
    GENERATOR_STATS.reset()
    validate_schema(schema)  # raises on a schema that is not valid OpenAPI 3
    return schema, problems


def test_the_openapi_schema_generates_without_a_warning() -> None:
    # `manage.py spectacular --fail-on-warn` in a test: a view whose body or answer the
    # generator has to guess, or two operations with one operationId, is a schema a
    # generated client gets wrong
    _, problems = _schema()
    assert problems == []


def test_every_api_operation_names_how_a_key_is_sent() -> None:
    schema, _ = _schema()
    schemes = schema["components"]["securitySchemes"]
    assert schemes["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a team's API key",
    }
    assert schemes["apiKeyHeader"] == {"type": "apiKey", "in": "header", "name": "X-API-Key"}
    open_paths = {"/api/v1/version"}
    unkeyed = []
    for path, operations in schema["paths"].items():
        if not path.startswith("/api/v1/") or path in open_paths or "/admin/" in path:
            continue
        for method, operation in operations.items():
            ways = [set(r) for r in operation.get("security", [])]
            # either header alone is enough: two requirement objects, not one with both
            if {"bearerAuth"} not in ways or {"apiKeyHeader"} not in ways:
                unkeyed.append(f"{method.upper()} {path}")
    assert unkeyed == []
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    assert "v1_tasks_list" in ids and "v1_audits_list" in ids


def test_get_and_post_of_one_view_keep_their_own_descriptions() -> None:
    schema, _ = _schema()
    wait = schema["paths"]["/api/v1/sandboxes/{sandbox_id}/wait"]
    assert wait["get"]["description"].startswith("Blocks until the sandbox is ready")
    assert "requestBody" not in wait["post"]
    assert wait["post"]["description"].startswith("The same wait as GET")
