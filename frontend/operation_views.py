"""Past command output on the sandbox page (issue 24, defect 8): an operation row opens
to its stored stdout and stderr (the windows the server kept: each stream whole up to
1 MiB, else its first and last 512 KiB), and downloads them as one text file.

The page shows at most the last ``SHOWN_LINES`` lines of each stream, like the live
console, and says how many it left out; the download has everything stored."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from apps.sandboxes import selectors
from apps.sandboxes.api.serializers import render_stream
from apps.sandboxes.models import Operation
from apps.tenancy.pages import page, render_page
from apps.tenancy.principal import Principal

SHOWN_LINES = 2_000


def _stream(meta: dict[str, Any]) -> dict[str, Any]:
    text = render_stream(meta or {})
    lines = text.splitlines(keepends=True)
    omitted = max(len(lines) - SHOWN_LINES, 0)
    return {
        "text": "".join(lines[omitted:]),
        "omitted": omitted,
        "truncated": bool((meta or {}).get("truncated")),
        "total_bytes": int((meta or {}).get("total_bytes", len(text.encode()))),
    }


def _operation(principal: Principal, sandbox_id: str, operation_id: str) -> Operation:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    return selectors.operation_get(
        tenant=principal.tenant, sandbox=sandbox, operation_id=operation_id
    )


@require_GET
@page()
def operation_output(
    request: HttpRequest, principal: Principal, sandbox_id: str, operation_id: str
) -> HttpResponse:
    operation = _operation(principal, sandbox_id, operation_id)
    return render_page(
        request,
        principal,
        "frontend/sandboxes/_operation_output.html",
        {
            "op": operation,
            "sandbox_id": sandbox_id,
            "stdout": _stream(operation.stdout),
            "stderr": _stream(operation.stderr),
            "shown_lines": SHOWN_LINES,
        },
    )


@require_GET
@page()
def operation_output_download(
    request: HttpRequest, principal: Principal, sandbox_id: str, operation_id: str
) -> HttpResponse:
    """stdout, then stderr under a marker line, as stored (a truncated stream keeps its
    "[… N bytes omitted …]" marker between its head and tail)."""
    operation = _operation(principal, sandbox_id, operation_id)
    body = render_stream(operation.stdout or {})
    stderr = render_stream(operation.stderr or {})
    if stderr:
        body += ("" if not body or body.endswith("\n") else "\n") + "--- stderr ---\n" + stderr
    response = HttpResponse(body, content_type="text/plain; charset=utf-8")
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in operation.operation_id)
    response["Content-Disposition"] = f'attachment; filename="{safe}.txt"'
    return response
