"""Sandbox pages. Reads go through selectors, writes through services, as in the API."""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from apps.billing.notices import notices_current
from apps.billing.usage import cost_for_sandboxes
from apps.core import keyset
from apps.core.errors import ApiError, NotFound
from apps.images.models import Image, ImageStatus
from apps.sandboxes import selectors
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.metering.usage import sandbox_cost
from apps.sandboxes.models import LIVE_STATES, State
from apps.sandboxes.services import files
from apps.sandboxes.services.egress import sandbox_dns_log
from apps.sandboxes.services.lifecycle import sandbox_create, sandbox_delete, sandbox_set_expiry
from apps.sandboxes.services.snapshots import sandbox_pause, sandbox_resume
from apps.tenancy.pages import is_htmx, page, render_page
from apps.tenancy.principal import Principal
from frontend.forms import sandbox_form_errors
from frontend.snapshot_views import sandbox_snapshots_context

PAGE_SIZE = 50
# at most this many sandboxes per bulk delete (one page's worth, twice over)
BULK_MAX = 200
FORM_DEFAULTS = {"image": "host", "cpu": "1", "memory": "1Gi", "ttl_seconds": "3600"}


def home(request: HttpRequest) -> HttpResponse:
    return redirect("frontend:sandboxes")


def _filters(request: HttpRequest) -> dict[str, str]:
    """The list's filters as the page shows them. No ``state`` at all means "live": a
    team opening the page wants what is running, not a history of deleted rows."""
    return {
        "state": request.GET.get("state", "live").strip() or "all",
        "image": request.GET.get("image", "").strip(),
        "q": request.GET.get("q", "").strip()[:200],
        "label": request.GET.get("label", "").strip()[:200],
        "sort": request.GET.get("sort", "newest"),
    }


def _states(value: str) -> list[str] | None:
    if value == "live":
        # queued ones too: waiting for capacity, a team wants them in view (and deletable)
        return [str(State.QUEUED), *(str(s) for s in LIVE_STATES)]
    if value == "all":
        return None
    known = {s.value for s in State}
    chosen = [s for s in value.split(",") if s in known]
    return chosen or None


def _labels(value: str) -> dict[str, str]:
    """``team=rl,seed=7`` → {"team": "rl", "seed": "7"}; parts without "=" are ignored."""
    pairs = (part.split("=", 1) for part in value.split(",") if "=" in part)
    return {k.strip(): v.strip() for k, v in pairs if k.strip()}


def _table_context(
    principal: Principal, filters: dict[str, str], cursor: str = ""
) -> dict[str, Any]:
    page = selectors.sandbox_page(
        tenant=principal.tenant,
        states=_states(filters["state"]),
        image=filters["image"] or None,
        search=filters["q"],
        labels=_labels(filters["label"]),
        sort=filters["sort"],
        cursor=cursor,
        limit=PAGE_SIZE,
    )
    rows = page.rows
    # Cost so far (live sandboxes accrue), one query for the page.
    costs = cost_for_sandboxes(sandbox_ids=[s.pk for s in rows])
    for row in rows:
        row.cost_so_far = costs.get(str(row.pk))  # type: ignore[attr-defined]
    query = {k: v for k, v in filters.items() if v and not (k == "sort" and v == "newest")}
    return {
        "sandboxes": rows,
        "next_cursor": page.next_cursor,
        "cursor": cursor,
        "next_query": urlencode({**query, "cursor": page.next_cursor}),
        "first_query": urlencode(query),
        "filters": filters,
        # the default view (Live) is not "filtered": an empty one says so plainly
        "filtered": filters["state"] not in ("live", "all")
        or any(filters[k] for k in ("image", "q", "label")),
        "has_any": bool(rows)
        or selectors.sandbox_page(tenant=principal.tenant, limit=1).rows != [],
        "bulk_states": [str(s) for s in LIVE_STATES] + [str(State.QUEUED)],
    }


def _images(principal: Principal) -> list[str]:
    """What the create form offers: the backend's built-in names (``host``, legacy
    imported root filesystems) and the team's own ready images — never the machine's
    whole image store, which holds other teams' images too."""

    builtin = {image.name for image in get_backend().images() if "/" not in image.name}
    mine = Image.objects.for_tenant(principal.tenant).filter(status=ImageStatus.READY)
    return sorted(builtin) + sorted(set(mine.values_list("reference", flat=True)) - builtin)


@require_GET
@page()
def sandbox_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    filters = _filters(request)
    return render_page(
        request,
        principal,
        "frontend/sandboxes/list.html",
        {
            **_table_context(principal, filters, request.GET.get("cursor", "")),
            "states": [s.value for s in State],
            "sorts": list(selectors.SANDBOX_SORTS),
            "images": _images(principal),
            "form": FORM_DEFAULTS,
            "errors": {},
            "nav_section": "sandboxes",
            "budget_notices": notices_current(tenant=principal.tenant),
        },
    )


@require_GET
@page()
def sandbox_table(request: HttpRequest, principal: Principal) -> HttpResponse:
    context = _table_context(principal, _filters(request), request.GET.get("cursor", ""))
    return render_page(request, principal, "frontend/sandboxes/_table.html", context)


@require_GET
@page()
def sandbox_quota(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The quota-use strip of the sandboxes page, re-read whenever a sandbox changes state
    (rendered once with the page it went stale: "0 concurrent" beside two live ones)."""
    return render_page(request, principal, "frontend/sandboxes/_quota.html")


@require_POST
@page("write")
def sandbox_create_view(request: HttpRequest, principal: Principal) -> HttpResponse:
    serializer, errors = sandbox_form_errors(request.POST)
    created = None
    if not errors:
        try:
            created, _ = sandbox_create(
                tenant=principal.tenant,
                request=serializer.to_request(),
                idempotency_key=request.POST.get("idempotency_key") or None,
                actor=principal.actor,
            )
        except ApiError as exc:
            # an image the backend cannot have: its stable code first (image_not_found,
            # registry_unauthorized, …), as the API answers it, then the registry's words
            typed = exc.field == "image" and exc.code != "bad_request"
            errors[exc.field or "form"] = f"{exc.code}: {exc.message}" if typed else exc.message
    if created is not None and not is_htmx(request):
        return redirect("frontend:sandbox", sandbox_id=created.external_id)
    context = {
        "form": FORM_DEFAULTS if created else request.POST,
        "errors": errors,
        "created": created,
        "images": _images(principal),
    }
    response = render_page(
        request,
        principal,
        "frontend/sandboxes/_create_form.html",
        context,
        status=200 if not errors else 400,
    )
    if created is not None:
        response["HX-Trigger"] = "sandboxes-changed"
    if errors:
        # htmx only swaps 2xx by default; the form re-renders in place with its errors.
        response["HX-Reswap"] = "outerHTML"
        response.status_code = 200 if is_htmx(request) else 400
    return response


@require_POST
@page("write")
def sandbox_delete_view(
    request: HttpRequest, principal: Principal, sandbox_id: str
) -> HttpResponse:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    sandbox_delete(sandbox=sandbox, actor=principal.actor)
    if is_htmx(request):
        response = HttpResponse(status=204)
        response["HX-Trigger"] = "sandboxes-changed"
        return response
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        target = reverse("frontend:sandboxes")  # never off-site (an open redirect)
    return redirect(target)


# The sandbox page's "Keep it for" choices (seconds from now; the API takes any value up
# to HEDGEROW_MAX_TTL_S, which caps these too).
TTL_CHOICES = [(3600, "1 hour"), (4 * 3600, "4 hours"), (24 * 3600, "24 hours")]


@require_POST
@page("write")
def sandbox_ttl_view(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    """Sets a live sandbox's TTL to the chosen time from now (the REST API's
    ``POST /sandboxes/{id}/timeout`` does the same with any value); answers a redirect to
    its page with what happened, so a reload changes nothing again."""
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    raw = request.POST.get("seconds", "")
    try:
        seconds = int(raw)
    except ValueError:
        messages.error(request, "Choose how long to keep the sandbox.")
    else:
        try:
            sandbox_set_expiry(sandbox=sandbox, seconds=seconds)
        except ApiError as exc:
            messages.error(request, f"The TTL was not changed: {exc.message}.")
        else:
            label = dict(TTL_CHOICES).get(seconds, f"{seconds} s")
            messages.success(request, f"{sandbox.external_id} now ends in {label}.")
    return redirect("frontend:sandbox", sandbox.external_id)


@require_POST
@page("write")
def sandbox_pause_view(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    """Pauses a ready sandbox (its state is captured, then its compute released; the
    API's ``POST /sandboxes/{id}/pause``); a redirect to its page says what happened."""
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    try:
        sandbox_pause(sandbox=sandbox, actor=principal.actor)
    except ApiError as exc:
        messages.error(request, f"{sandbox.external_id} was not paused: {exc.message}.")
    else:
        messages.success(
            request,
            f"Pausing {sandbox.external_id}: its state is being captured; Resume starts it "
            "again where it was.",
        )
    return redirect("frontend:sandbox", sandbox.external_id)


@require_POST
@page("write")
def sandbox_resume_view(
    request: HttpRequest, principal: Principal, sandbox_id: str
) -> HttpResponse:
    """Resumes a paused sandbox (admitted like a create, restored from its pause)."""
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    try:
        sandbox_resume(sandbox=sandbox, actor=principal.actor)
    except ApiError as exc:
        messages.error(request, f"{sandbox.external_id} was not resumed: {exc.message}.")
    else:
        messages.success(request, f"Resuming {sandbox.external_id} from its pause.")
    return redirect("frontend:sandbox", sandbox.external_id)


@require_POST
@page("write")
def sandbox_bulk_delete_view(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Deletes the chosen sandboxes (one confirmation naming the count, in the page).
    Ids of another team are not found, like everywhere; ones already ending are
    skipped. Answers with a message naming what happened."""
    ids = list(dict.fromkeys(request.POST.getlist("ids")))[:BULK_MAX]
    deleted = skipped = 0
    for sandbox_id in ids:
        try:
            sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        except NotFound:
            skipped += 1
            continue
        if (
            not (sandbox.is_live or sandbox.state == State.QUEUED)
            or sandbox.state == State.TERMINATING
        ):
            skipped += 1
            continue
        sandbox_delete(sandbox=sandbox, actor=principal.actor)
        deleted += 1
    text = f"Deleting {deleted} sandbox{'es' if deleted != 1 else ''}."
    if skipped:
        text += f" {skipped} skipped (not found or already ending)."
    if is_htmx(request):
        response = HttpResponse(text, status=200)
        response["HX-Trigger"] = "sandboxes-changed"
        return response
    messages.success(request, text)
    return redirect("frontend:sandboxes")


def _detail_context(principal: Principal, sandbox_id: str) -> dict[str, Any]:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    return {
        "sandbox": sandbox,
        "events": list(selectors.sandbox_events(sandbox=sandbox)),
        "cost": sandbox_cost(sandbox=sandbox),
        "ttl_choices": [c for c in TTL_CHOICES if c[0] <= settings.HEDGEROW_MAX_TTL_S],
    }


@require_GET
@page()
def sandbox_detail(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    context = _detail_context(principal, sandbox_id)
    sandbox = context["sandbox"]
    context.update(
        # the file browser opens where the URL says (?path=…), so a reload keeps its place
        files_path=request.GET.get("path") or "/workspace",
        **operations_context(principal, sandbox, None),
        nav_section="sandboxes",
        dns_entries=_dns_entries(sandbox),
        **sandbox_snapshots_context(principal, sandbox),
    )
    return render_page(request, principal, "frontend/sandboxes/detail.html", context)


DNS_PAGE_ENTRIES = 100  # the last ones, on the sandbox page (the API has up to 1000)


def _dns_entries(sandbox: Any) -> list[dict[str, Any]] | None:
    """The sandbox's last DNS queries (issue 21), or None when its policy is not routed
    (no resolver serves it) and it has none: the page then shows no panel."""

    try:
        entries = sandbox_dns_log(sandbox=sandbox)
    except BackendError:
        return None
    if not entries and not sandbox.network_access:
        return None
    return entries[-DNS_PAGE_ENTRIES:]


@require_GET
@page()
def sandbox_header(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    context = _detail_context(principal, sandbox_id)
    return render_page(request, principal, "frontend/sandboxes/_header.html", context)


@require_GET
@page()
def sandbox_timeline(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    context = _detail_context(principal, sandbox_id)
    return render_page(request, principal, "frontend/sandboxes/_timeline.html", context)


@require_GET
@page()
def sandbox_operations(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    return render_page(
        request,
        principal,
        "frontend/sandboxes/_operations.html",
        operations_context(principal, sandbox, request.GET.get("cursor")),
    )


OPERATIONS_PAGE = 20  # commands per page of the sandbox page's operations panel


def operations_context(principal: Principal, sandbox: Any, cursor: str | None) -> dict[str, Any]:
    """One page of the sandbox's operations, newest first: keyset pages on
    (created_at, id), so every command is reachable however many ran, and a page stays
    put while new ones arrive. A bad cursor is the newest page."""
    page_ = keyset.newest_first(
        selectors.operation_list(tenant=principal.tenant, sandbox=sandbox),
        cursor=cursor or "",
        limit=OPERATIONS_PAGE,
    )
    return {
        "sandbox": sandbox,
        "operations": page_.rows,
        "ops_cursor": cursor or "",
        "ops_next_cursor": page_.next_cursor,
    }


@require_GET
@page()
def sandbox_files(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    return files_listing(request, principal, sandbox, request.GET.get("path") or "/workspace")


def files_listing(
    request: HttpRequest,
    principal: Principal,
    sandbox: Any,
    path: str,
    *,
    message: str = "",
    action_error: str = "",
) -> HttpResponse:
    """The file browser's listing of ``path`` (the partial the page swaps into #files)."""
    listing: dict[str, Any] = {}
    error = ""
    try:
        listing = files.file_list(sandbox=sandbox, path=path)
    except ApiError as exc:
        error = exc.message
    entries = sorted(
        listing.get("entries", []), key=lambda e: (e.get("type") != "directory", e.get("name", ""))
    )
    parts = [p for p in path.split("/") if p]
    crumbs = [{"name": p, "path": "/" + "/".join(parts[: i + 1])} for i, p in enumerate(parts)]
    return render_page(
        request,
        principal,
        "frontend/sandboxes/_files.html",
        {
            "sandbox": sandbox,
            "path": path,
            "parent": posixpath.dirname(path.rstrip("/")) if path != "/" else "",
            "crumbs": crumbs,
            "entries": entries,
            "error": error,
            "message": message,
            "action_error": action_error,
        },
    )
