"""One version (issue 26 defect 9): the server, its OpenAPI document, the SDK package
and what episodes record agree, and the server says which SDKs it supports."""

from __future__ import annotations

import re
from pathlib import Path

import hedgerow
import httpx
import pytest
from hedgerow import Client

from apps.trajectories.models import Episode

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def test_it_serves_one_version_without_a_key(live):
    body = httpx.get(f"{live.url}/api/v1/version", trust_env=False).json()
    assert body == {
        "version": hedgerow.__version__,
        "api": "v1",
        "sdk": {"minimum": "0.2.0", "current": hedgerow.__version__},
    }
    schema = httpx.get(f"{live.url}/api/schema/", params={"format": "json"}, trust_env=False)
    assert schema.json()["info"]["version"] == hedgerow.__version__
    assert "/api/v1/version" in schema.json()["paths"]


def test_it_keeps_the_package_changelog_and_policy_in_step():
    pyproject = (ROOT / "sdk" / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == hedgerow.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {hedgerow.__version__}" in changelog
    assert "## Versions and compatibility" in (ROOT / "docs" / "sdk.md").read_text()


def test_it_reports_compatibility_and_records_the_real_client_version(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr:
        server = hr.server_version()
        assert (server.version, server.client, server.compatible) == (
            hedgerow.__version__,
            hedgerow.__version__,
            True,
        )
        old = hedgerow.ServerVersion.from_api(
            {"version": "9.0.0", "api": "v9", "sdk": {"minimum": "1.10.0", "current": "9.0.0"}},
            client="1.9.3",
        )
        assert not old.compatible
        with hr.create_sandbox() as sandbox, sandbox.episode(task_id="versions") as ep:
            sandbox.exec("true")
        recorded = Episode.objects.get(tenant=tenant, episode_id=ep.id).versions
        assert recorded["client"] == f"hedgerow-python/{hedgerow.__version__}"
