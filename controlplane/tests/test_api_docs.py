"""The API docs page loads Swagger UI from our own pinned static files, never a CDN."""

from __future__ import annotations

import re

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
