"""Snapshot pages (issue 16): a sandbox's snapshots, one snapshot's fingerprint and
children with their divergence, and the fork dialog. Reads through selectors, the
fork through the same service as the API (all K or none, quotas, tenancy)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from apps.billing.storage import storage_cost_for_snapshots
from apps.core.errors import ApiError
from apps.sandboxes import selectors
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services.snapshots import MAX_FORK, snapshot_fork
from apps.tenancy.pages import page, render_page
from apps.tenancy.principal import Principal

CHILDREN_SHOWN = 100


def sandbox_snapshots_context(principal: Principal, sandbox: Sandbox) -> dict[str, Any]:
    """The sandbox page's snapshot panel: its kept (or capturing) snapshots, with what
    keeping each costs so far."""
    snapshots = list(selectors.snapshot_list(tenant=principal.tenant, sandbox=sandbox)[:50])
    costs = storage_cost_for_snapshots(snapshot_ids=[s.pk for s in snapshots])
    for snapshot in snapshots:
        snapshot.storage_cost = costs.get(snapshot.pk)  # type: ignore[attr-defined]
    return {"snapshots": snapshots}


@require_GET
@page()
def snapshot_detail(request: HttpRequest, principal: Principal, snapshot_id: str) -> HttpResponse:
    snapshot = selectors.snapshot_get(tenant=principal.tenant, snapshot_id=snapshot_id)
    children = list(
        Sandbox.objects.filter(tenant=principal.tenant, snapshot=snapshot).order_by(
            "-created_at", "-id"
        )[:CHILDREN_SHOWN]
    )
    fingerprint = snapshot.fingerprint or {}
    return render_page(
        request,
        principal,
        "frontend/snapshots/detail.html",
        {
            "snapshot": snapshot,
            "fingerprint": fingerprint,
            "probes": [
                {
                    **probe,
                    "text": probe["command"]
                    if isinstance(probe["command"], str)
                    else " ".join(probe["command"]),
                    "result": (fingerprint.get("probes") or {}).get(probe["name"], {}),
                }
                for probe in snapshot.probes or []
            ],
            "manifest_json": json.dumps(snapshot.manifest, indent=2, sort_keys=True),
            "storage_cost": storage_cost_for_snapshots(snapshot_ids=[snapshot.pk]).get(snapshot.pk),
            "children": children,
            "diverged": sum(1 for c in children if c.divergence),
            "max_fork": MAX_FORK,
            "nav_section": "sandboxes",
        },
    )


@require_POST
@page("write")
def snapshot_fork_view(
    request: HttpRequest, principal: Principal, snapshot_id: str
) -> HttpResponse:
    """The fork dialog's submit: K children, all or none. A refusal (quota, a snapshot
    not ready, a bad count) is shown on the page, nothing created."""
    snapshot = selectors.snapshot_get(tenant=principal.tenant, snapshot_id=snapshot_id)
    raw = request.POST.get("count", "").strip()
    try:
        count = int(raw)
    except ValueError:
        messages.error(request, f"Fork: the number of children must be 1 to {MAX_FORK}.")
        return redirect("frontend:snapshot", snapshot_id=str(snapshot.pk))
    try:
        children, _ = snapshot_fork(
            tenant=principal.tenant,
            snapshot=snapshot,
            count=count,
            idempotency_key=None,
            actor=principal.actor,
        )
    except ApiError as exc:
        messages.error(request, f"Fork refused: {exc.message}")
    else:
        n = len(children)
        messages.success(
            request,
            f"Forked {n} sandbox{'es' if n != 1 else ''}: each is ready once its state "
            "matched the snapshot's fingerprint.",
        )
    return redirect("frontend:snapshot", snapshot_id=str(snapshot.pk))
