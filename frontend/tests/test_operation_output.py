"""Past command output can be opened (issue 24, defect 8): an operation row expands to
its stored stdout and stderr, bounded on the page, with the whole stored output as a
download. Another team's operation does not exist."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.tests.factories import make_sandbox
from frontend.operation_views import SHOWN_LINES

pytestmark = pytest.mark.django_db


def _operation(sandbox: Any, op_id: str, stdout: dict[str, Any], stderr: dict[str, Any]) -> Any:
    return Operation.objects.create(
        tenant=sandbox.tenant,
        sandbox=sandbox,
        operation_id=op_id,
        generation=1,
        request={"command": "python train.py"},
        request_hash="x",
        status=OperationStatus.COMPLETED,
        termination="exited",
        exit_code=1,
        stdout=stdout,
        stderr=stderr,
    )


def _signed_in(make_user: Any, tenant: Any, name: str) -> Client:
    make_user(name, (tenant, "viewer"))
    client = Client()
    assert client.login(username=name, password=name)
    return client


def test_an_operation_row_opens_to_its_stored_output_and_downloads_it(make_tenant, make_user):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    many = "".join(f"line {i}\n" for i in range(SHOWN_LINES + 500))
    _operation(
        sandbox,
        "op-train",
        {"head": many, "tail": "", "truncated": False, "total_bytes": len(many)},
        {"head": "Traceback <boom>\n", "tail": "", "truncated": False, "total_bytes": 17},
    )
    client = _signed_in(make_user, tenant, "opviewer")
    detail = client.get(f"/sandboxes/{sandbox.external_id}/").content.decode()
    assert 'aria-label="Output of op-train"' in detail
    output_url = f"/sandboxes/{sandbox.external_id}/operations/op-train/output"
    assert f'hx-get="{output_url}"' in detail

    shown = client.get(output_url).content.decode()
    assert "500 earlier stdout lines omitted" in shown
    assert "line 499\n" not in shown and "line 500\n" in shown and "line 2499\n" in shown
    assert "Traceback &lt;boom&gt;" in shown  # escaped, never markup
    assert f'href="{output_url}.txt"' in shown

    download = client.get(output_url + ".txt")
    assert download.status_code == 200
    assert download["Content-Disposition"] == 'attachment; filename="op-train.txt"'
    assert download.content.decode() == many + "--- stderr ---\nTraceback <boom>\n"


def test_a_truncated_stream_keeps_its_marker_and_another_teams_operation_is_not_found(
    make_tenant, make_user
):
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    theirs = make_sandbox(other)
    _operation(
        sandbox,
        "op-big",
        {"head": "start\n", "tail": "end\n", "truncated": True, "total_bytes": 5_000_000},
        {},
    )
    _operation(theirs, "op-secret", {"head": "their output"}, {})
    client = _signed_in(make_user, tenant, "opviewer2")
    shown = client.get(f"/sandboxes/{sandbox.external_id}/operations/op-big/output")
    html = shown.content.decode()
    assert "kept as the first and last 512 KiB" in html
    assert "[… 4999990 bytes omitted …]" in html
    assert "stderr" not in html.split("Download output")[1]  # no empty stderr box
    for path in ("output", "output.txt"):
        assert (
            client.get(f"/sandboxes/{theirs.external_id}/operations/op-secret/{path}").status_code
            == 404
        )
        assert (
            client.get(f"/sandboxes/{sandbox.external_id}/operations/op-secret/{path}").status_code
            == 404
        )


def test_older_operations_are_reachable_in_cursor_pages(make_tenant, make_user):
    """Only the newest 20 were listed (later: up to 500): an SDK loop's earlier commands
    had no row to open. The panel pages by cursor, 20 at a time, newest first, to the
    very first command; a page's live refresh keeps its cursor; another sandbox's
    commands are on no page."""
    import re
    from datetime import timedelta
    from html import unescape

    from django.utils import timezone

    from frontend.views import OPERATIONS_PAGE

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    neighbour = make_sandbox(tenant)
    _operation(neighbour, "op-neighbour", {"head": "n\n"}, {})
    start = timezone.now() - timedelta(hours=1)
    total = 2 * OPERATIONS_PAGE + 5
    for i in range(total):
        op = _operation(sandbox, f"op-{i:02d}", {"head": f"{i}\n"}, {})
        # the first ten share one instant: the id breaks the tie, none repeats or hides
        at = start + timedelta(seconds=max(i, 9))
        Operation.objects.filter(pk=op.pk).update(created_at=at)
    client = _signed_in(make_user, tenant, "opolder")
    base = f"/sandboxes/{sandbox.external_id}/operations"
    detail = client.get(f"/sandboxes/{sandbox.external_id}/").content.decode()
    assert f'hx-get="{base}" hx-trigger="refresh"' in detail
    assert "Newest commands" not in detail

    def ops(html: str) -> list[str]:
        return re.findall(r'aria-label="Output of (op-[^"]+)"', html)

    def older(html: str) -> str | None:
        found = re.search(r'hx-get="([^"]*\?cursor=[^"]+)"\s+hx-target="#operations"', html)
        return unescape(found.group(1)) if found else None

    pages = [ops(detail)]
    url = older(detail)
    while url is not None:
        html = client.get(url).content.decode()
        pages.append(ops(html))
        query = url.split("?", 1)[1]
        assert f'hx-get="{base}?{query}" hx-trigger="refresh"' in html.replace("&amp;", "&")
        assert "Newest commands" in html
        refreshed = client.get(url).content.decode()  # what the live refresh fetches
        assert ops(refreshed) == pages[-1]
        url = older(html)
        assert len(pages) < 10
    assert [len(p) for p in pages] == [OPERATIONS_PAGE, OPERATIONS_PAGE, 5]
    expected = Operation.objects.filter(sandbox=sandbox).order_by("-created_at", "-id")
    seen = [op_id for page in pages for op_id in page]
    assert seen == [o.operation_id for o in expected]
    assert pages[0][0] == f"op-{total - 1:02d}" and "op-neighbour" not in seen

    for bad in ("x", "Zm9v", "-5"):  # not a cursor this page gave: the newest page
        assert ops(client.get(base, {"cursor": bad}).content.decode()) == pages[0]
