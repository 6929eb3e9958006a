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


def test_older_operations_are_reachable_twenty_at_a_time(make_tenant, make_user):
    """Only the newest 20 were listed: an SDK loop's earlier commands had no row to
    open. "Show older commands" adds 20 at a time, and the panel's refresh keeps them."""
    from datetime import timedelta

    from django.utils import timezone

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    start = timezone.now() - timedelta(hours=1)
    for i in range(45):
        op = _operation(sandbox, f"op-{i:02d}", {"head": f"{i}\n"}, {})
        Operation.objects.filter(pk=op.pk).update(created_at=start + timedelta(seconds=i))
    client = _signed_in(make_user, tenant, "opolder")
    detail = client.get(f"/sandboxes/{sandbox.external_id}/").content.decode()
    base = f"/sandboxes/{sandbox.external_id}/operations"
    assert detail.count('aria-label="Output of op-') == 20
    assert "Output of op-44" in detail and "Output of op-25" in detail
    assert "Output of op-24" not in detail
    assert f'hx-get="{base}?shown=20" hx-trigger="refresh"' in detail
    assert f'hx-get="{base}?shown=40"' in detail and "Show older commands" in detail

    more = client.get(base, {"shown": "40"}).content.decode()
    assert more.count('aria-label="Output of op-') == 40 and "Output of op-05" in more
    assert f'hx-get="{base}?shown=40" hx-trigger="refresh"' in more  # a refresh keeps 40
    last = client.get(base, {"shown": "60"}).content.decode()
    assert last.count('aria-label="Output of op-') == 45 and "Output of op-00" in last
    assert "Show older commands" not in last
    for bad in ("-5", "x", "7"):  # not a count: the newest 20
        assert client.get(base, {"shown": bad}).content.decode().count("Output of op-") == 20
