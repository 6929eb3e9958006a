"""Keys and Images lists page like the sandboxes list (issue 24 defect 3): cursor pages,
newest first, that reach every row exactly once — also rows created in the same
instant — with another team's rows never on any page and a bad cursor starting over."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.images.models import Image, ImageStatus
from apps.images.views import IMAGES_PAGE
from apps.tenancy.models import ApiKey
from frontend.team_views import KEYS_PAGE

pytestmark = pytest.mark.django_db


def _client(make_user: Any, tenant: Any, name: str) -> Client:
    make_user(name, (tenant, "owner"))
    client = Client()
    assert client.login(username=name, password=name)
    return client


def _next(html: str) -> str | None:
    found = re.search(r'href="([^"]*\?cursor=[^"]+)" rel="next"', html)
    return unescape(found.group(1)) if found else None


def _walk(client: Client, url: str, row: str) -> tuple[list[list[str]], list[str]]:
    """Every page from ``url`` by its "Next page" links: the rows of each, and the
    pages' HTML (to check the way back)."""
    pages: list[list[str]] = []
    htmls: list[str] = []
    next_url: str | None = url
    while next_url is not None:
        response = client.get(next_url)
        assert response.status_code == 200
        html = response.content.decode()
        pages.append(re.findall(row, html))
        htmls.append(html)
        next_url = _next(html)
        assert len(pages) < 10, "the pages never end"
    return pages, htmls


def _key(tenant: Any, name: str, at: Any) -> ApiKey:
    return ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=uuid.uuid4().hex[:8],
        secret_hash=uuid.uuid4().hex + uuid.uuid4().hex,
        scopes=["read"],
        created_at=at,
    )


def test_keys_page_through_every_key_of_the_team_once(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    now = timezone.now()
    total = KEYS_PAGE + 7
    # ten keys share one instant: the cursor's id tie-break keeps them all reachable
    for i in range(total):
        _key(tenant, f"k{i:03d}", now - timedelta(seconds=max(i, 10)))
    _key(other, "foreign-key", now)
    client = _client(make_user, tenant, "keypager")

    pages, htmls = _walk(client, "/keys/", r'data-key-prefix="([^"]+)"')
    assert ApiKey.objects.filter(tenant=tenant).count() == total + 1  # + make_tenant's key
    assert [len(p) for p in pages] == [KEYS_PAGE, 8]
    seen = [prefix for page in pages for prefix in page]
    expected = ApiKey.objects.filter(tenant=tenant).order_by("-created_at", "-id")
    assert seen == [k.prefix for k in expected]  # newest first, each once
    assert all("foreign-key" not in html for html in htmls)
    assert "« First page" not in htmls[0] and "« First page" in htmls[1]
    assert 'rel="next"' not in htmls[1]

    garbage = client.get("/keys/", {"cursor": "not-a-cursor!"}).content.decode()
    assert re.findall(r'data-key-prefix="([^"]+)"', garbage) == pages[0]


def test_keys_under_a_page_show_no_pager(make_tenant, make_user):
    tenant, _ = make_tenant()
    _key(tenant, "only", timezone.now())
    html = _client(make_user, tenant, "keyfew").get("/keys/").content.decode()
    # this key and make_tenant's
    assert html.count("data-key-prefix=") == 2 and 'aria-label="Key pages"' not in html


def test_images_page_through_every_image_of_the_team_once(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    now = timezone.now()
    total = IMAGES_PAGE + 3
    for i in range(total):
        Image.objects.create(
            tenant=tenant,
            reference=f"ghcr.io/acme/img{i:03d}:1",
            status=ImageStatus.READY,
            created_at=now - timedelta(seconds=max(i, 5)),
        )
    Image.objects.create(tenant=other, reference="ghcr.io/foreign/x:1", status=ImageStatus.READY)
    # the oldest image is still pulling: it is on page 2, and page 1 keeps re-reading
    oldest = Image.objects.filter(tenant=tenant, reference="ghcr.io/acme/img052:1")
    oldest.update(status=ImageStatus.PULLING)
    client = _client(make_user, tenant, "imgpager")

    pages, htmls = _walk(client, "/images/", r'data-image-id="([^"]+)"')
    assert [len(p) for p in pages] == [IMAGES_PAGE, 3]
    seen = [pk for page in pages for pk in page]
    expected = Image.objects.filter(tenant=tenant).order_by("-created_at", "-id")
    assert seen == [str(i.pk) for i in expected]
    assert all("ghcr.io/foreign/x:1" not in html for html in htmls)
    assert 'data-pulling="yes"' in htmls[0]
    assert "« First page" in htmls[1] and 'rel="next"' not in htmls[1]

    # the table's live re-read keeps its page
    cursor = _next(htmls[0])
    assert cursor is not None
    query = cursor.split("?", 1)[1]
    assert f'hx-get="/images/table?{query}"' in htmls[1].replace("&amp;", "&")
    table = client.get(f"/images/table?{query}").content.decode()
    assert re.findall(r'data-image-id="([^"]+)"', table) == pages[1]
