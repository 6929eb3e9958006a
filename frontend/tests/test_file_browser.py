"""The file browser's writes are the team's and writers' only: another team's sandbox is
a 404, a viewer is refused, and the workspace root itself cannot be deleted."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db


def test_file_writes_are_refused_to_viewers_and_other_teams(make_tenant, make_user):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    theirs = make_sandbox(other)
    mine = make_sandbox(tenant)
    make_user("fowner", (tenant, "owner"))
    make_user("fviewer", (tenant, "viewer"))
    owner, viewer = Client(), Client()
    assert owner.login(username="fowner", password="fowner")
    assert viewer.login(username="fviewer", password="fviewer")
    for client, sandbox, status in ((owner, theirs, 404), (viewer, mine, 403)):
        url = f"/sandboxes/{sandbox.external_id}/files"
        deleted = client.post(url + "/delete", {"path": "/workspace/x"})
        assert deleted.status_code == status
        assert client.get(url + "/exists", {"path": "/workspace/x"}).status_code == status
        made = client.post(url + "/mkdir", {"dir": "/workspace", "name": "x"})
        assert made.status_code == status


def test_the_detail_page_opens_the_file_browser_where_the_url_says(make_tenant, make_user):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    make_user("fmember", (tenant, "member"))
    client = Client()
    assert client.login(username="fmember", password="fmember")
    html = client.get(f"/sandboxes/{sandbox.external_id}/", {"path": "/workspace/a b"})
    assert f'/sandboxes/{sandbox.external_id}/files?path=/workspace/a%20b"' in html.content.decode()
