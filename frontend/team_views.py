"""Sign in/out, the team switcher, API keys and members."""

from __future__ import annotations

import secrets
import uuid
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_http_methods, require_POST

from apps.core import keyset
from apps.core.errors import ApiError, NotFound
from apps.tenancy import activity, selectors, services
from apps.tenancy.auth import principal_for_session
from apps.tenancy.models import Action, Role, Scope
from apps.tenancy.pages import page, render_page
from apps.tenancy.principal import Principal

EXPIRY_CHOICES = [("", "Never"), ("7", "7 days"), ("30", "30 days"), ("90", "90 days")]


class LoginView(auth_views.LoginView):
    template_name = "frontend/login.html"
    redirect_authenticated_user = True


class LogoutView(auth_views.LogoutView):
    pass


@require_POST
def team_switch(request: HttpRequest) -> HttpResponse:
    """Stores the chosen team in the session if the user is a member of it."""
    if not request.user.is_authenticated:
        return redirect("frontend:login")
    tenant_id = request.POST.get("tenant_id", "")
    try:
        uuid.UUID(tenant_id)
    except ValueError:
        return HttpResponseBadRequest(
            "invalid_team: tenant_id must be a team id", content_type="text/plain"
        )
    principal = principal_for_session(request.user, tenant_id)
    if principal is not None and str(principal.tenant.pk) == tenant_id:
        request.session["tenant_id"] = tenant_id
    target = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        target = "/"
    # Object pages of the old team would be 404s in the new one.
    if target.startswith("/sandboxes/") and target != "/sandboxes/":
        target = "/sandboxes/"
    return redirect(target)


KEYS_PAGE = 50  # keys per page of the keys list (cursor pages, newest first)


def _keys_context(principal: Principal, cursor: str = "") -> dict[str, Any]:
    page_ = keyset.newest_first(
        selectors.api_key_list(tenant=principal.tenant), cursor=cursor, limit=KEYS_PAGE
    )
    return {
        "keys": page_.rows,
        "cursor": cursor,
        "next_cursor": page_.next_cursor,
        "scopes": [s.value for s in Scope],
        "expiry_choices": EXPIRY_CHOICES,
        "now": timezone.now(),
        "checked_scopes": ["read", "write"],
        "grace_choices": ROTATION_GRACE_CHOICES,
        "nav_section": "keys",
    }


@require_http_methods(["GET", "POST"])
@page("admin")
def keys(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Lists keys; POST issues one, then redirects (post/redirect/get: a reload must not
    mint a second key) to this page, which shows its secret once."""
    context = _keys_context(principal, request.GET.get("cursor", ""))
    if request.method == "GET":
        shown = _take_issued_key(request, principal)
        if shown is not None:
            context.update(issued=shown)
    if request.method == "POST":
        name = request.POST.get("name", "").strip()
        scopes = request.POST.getlist("scopes")
        errors: dict[str, str] = {}
        if not name:
            errors["name"] = "Give the key a name, e.g. the job or person that uses it."
        if not scopes:
            errors["scopes"] = "Choose at least one scope."
        expires_at: datetime | None = None
        days = request.POST.get("expires_in_days", "")
        if days:
            if not days.isdigit() or not 1 <= int(days) <= 3650:
                errors["expires_in_days"] = "Choose an expiry."
            else:
                expires_at = timezone.now() + timedelta(days=int(days))
        if not errors:
            try:
                issued = services.api_key_create(
                    tenant=principal.tenant,
                    name=name,
                    scopes=scopes,
                    expires_at=expires_at,
                    created_by=request.user,  # type: ignore[arg-type]
                    granted_by=principal.scopes,
                    actor=principal.actor,
                )
            except ApiError as exc:
                errors[exc.field or "form"] = exc.message
            else:
                _hold_issued_key(request, issued)
                return redirect("frontend:keys")
        context.update(errors=errors, form=request.POST, checked_scopes=scopes)
        # 200, like Django's form views: the page is the answer (a 4xx shows as a
        # console error and the form is what the user needs to see).
        return render_page(request, principal, "frontend/keys.html", context)
    return render_page(request, principal, "frontend/keys.html", context)


# The secret crosses the redirect in Redis (no persistence, 2-minute TTL) under a
# random handle kept in the session: never in a URL, a cookie or the session table.
_ISSUED_TTL_S = 120


def _hold_issued_key(
    request: HttpRequest, issued: services.IssuedKey, *, rotated: bool = False
) -> None:
    handle = secrets.token_urlsafe(24)
    cache.set(
        f"issued-key:{handle}",
        {"key": str(issued.key.pk), "secret": issued.secret, "rotated": rotated},
        _ISSUED_TTL_S,
    )
    request.session["issued_key"] = handle


def _take_issued_key(request: HttpRequest, principal: Principal) -> dict[str, Any] | None:
    """The key issued by this session's last POST, once: the handle and the secret are
    deleted as they are read, so a reload shows the list without it."""
    handle = request.session.pop("issued_key", None)
    if not isinstance(handle, str):
        return None
    held = cache.get(f"issued-key:{handle}")
    cache.delete(f"issued-key:{handle}")
    if not isinstance(held, dict):
        return None
    try:
        key = selectors.api_key_get(tenant=principal.tenant, key_id=held["key"])
    except NotFound:  # another team now (switched teams in between): not shown here
        return None
    return {"key": key, "secret": held["secret"], "rotated": bool(held.get("rotated"))}


@require_POST
@page("admin")
def key_revoke(request: HttpRequest, principal: Principal, key_id: str) -> HttpResponse:
    key = selectors.api_key_get(tenant=principal.tenant, key_id=key_id)
    services.api_key_revoke(key=key, actor=principal.actor)
    messages.success(request, f"Revoked {key.name} ({key.prefix}…). Requests with it now fail.")
    return redirect("frontend:keys")


@require_POST
@page("admin")
def key_rename(request: HttpRequest, principal: Principal, key_id: str) -> HttpResponse:
    key = selectors.api_key_get(tenant=principal.tenant, key_id=key_id)
    old = key.name
    try:
        key = services.api_key_rename(
            key=key, name=request.POST.get("name", ""), actor=principal.actor
        )
    except ApiError as exc:
        messages.error(request, f"{old} was not renamed: {exc.message}.")
    else:
        messages.success(request, f"Renamed {old} to {key.name}.")
    return redirect("frontend:keys")


ROTATION_GRACE_CHOICES = [
    ("0", "none: the old secret stops now"),
    ("3600", "1 hour"),
    ("86400", "24 hours"),
    ("604800", "7 days"),
]


@require_POST
@page("admin")
def key_rotate(request: HttpRequest, principal: Principal, key_id: str) -> HttpResponse:
    """A new secret, shown once on the keys page after the redirect (like a new key);
    the old one works for the chosen grace period."""
    key = selectors.api_key_get(tenant=principal.tenant, key_id=key_id)
    raw = request.POST.get("grace_seconds", "")
    try:
        issued = services.api_key_rotate(
            key=key,
            actor=principal.actor,
            grace_seconds=int(raw) if raw.isdigit() else None,
        )
    except ApiError as exc:
        messages.error(request, f"{key.name} was not rotated: {exc.message}.")
    else:
        _hold_issued_key(request, issued, rotated=True)
    return redirect("frontend:keys")


def _members_context(principal: Principal) -> dict[str, Any]:
    roles = [r.value for r in Role]
    grantable = roles if principal.role == Role.OWNER else [r for r in roles if r != Role.OWNER]
    return {
        "members": list(selectors.membership_list(tenant=principal.tenant)),
        "roles": roles,
        "grantable": grantable,
        "can_manage": principal.role in (Role.OWNER, Role.ADMIN),
        "nav_section": "members",
    }


@require_http_methods(["GET", "POST"])
@page()
def members(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Everyone sees the team; owners/admins add users and change roles (server-checked)."""
    context = _members_context(principal)
    if request.method == "GET":
        return render_page(request, principal, "frontend/members.html", context)
    errors: dict[str, str] = {}
    message = ""
    try:
        if request.POST.get("action") == "add":
            added = services.membership_add(
                actor=principal.actor,
                tenant=principal.tenant,
                username=request.POST.get("username", ""),
                role=request.POST.get("role", Role.MEMBER),
                by_role=principal.role,
            )
            message = f"Added {added.user.username} as {added.role}."
        elif request.POST.get("action") == "remove":
            membership = selectors.membership_get(
                tenant=principal.tenant, membership_id=request.POST.get("membership_id", "")
            )
            services.membership_remove(
                membership=membership, by_role=principal.role, actor=principal.actor
            )
            message = f"Removed {membership.user.username} from the team."
        else:
            membership = selectors.membership_get(
                tenant=principal.tenant, membership_id=request.POST.get("membership_id", "")
            )
            changed = services.membership_change_role(
                membership=membership,
                role=request.POST.get("role", ""),
                by_role=principal.role,
                actor=principal.actor,
            )
            message = f"{changed.user.username} is now {changed.role}."
    except NotFound:
        raise  # another team's member: a 404 (``page``), like every other object
    except ApiError as exc:
        if exc.status_code == 403:
            context.update(error=exc.message)
            return render_page(request, principal, "frontend/members.html", context, status=403)
        errors[exc.field or "form"] = exc.message
    if not errors:
        messages.success(request, message)
        return redirect("frontend:members")
    context.update(errors=errors, form=request.POST)
    return render_page(request, principal, "frontend/members.html", context)


ACTION_LABELS = {
    Action.KEY_CREATED: "created key",
    Action.KEY_REVOKED: "revoked key",
    Action.KEY_RENAMED: "renamed key",
    Action.KEY_ROTATED: "rotated key",
    Action.MEMBER_ADDED: "added member",
    Action.MEMBER_ROLE_CHANGED: "changed the role of",
    Action.MEMBER_REMOVED: "removed member",
    Action.SANDBOX_DELETED: "deleted sandbox",
    Action.QUOTA_CHANGED: "changed",
    Action.BUDGET_CROSSED: "crossed",
}


@require_http_methods(["GET"])
@page("admin")
def activity_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The team's activity log, newest first, a page at a time (cursor in the URL), with
    an action filter and CSV/JSONL export (the API's export, on the session)."""
    chosen = request.GET.get("action", "")
    try:
        qs = activity.activity_list(tenant=principal.tenant, action=chosen or None)
        page_ = activity.activity_page(qs, cursor=request.GET.get("cursor"), limit=50)
    except ApiError as exc:
        return render_page(
            request,
            principal,
            "frontend/activity.html",
            {"error": exc.message, "entries": [], "nav_section": "activity", **_filters(chosen)},
            status=400,
        )
    entries = [
        {
            "entry": entry,
            "verb": ACTION_LABELS.get(Action(entry.action), entry.action),
            "details": _detail_texts(entry.details),
        }
        for entry in page_.rows
    ]
    query = {"action": chosen} if chosen else {}
    context = {
        "entries": entries,
        "next_url": "?" + urlencode({**query, "cursor": page_.next_cursor})
        if page_.next_cursor
        else "",
        "is_first_page": not request.GET.get("cursor"),
        "export_query": urlencode(query),
        "retention_days": settings.HEDGEROW_ACTIVITY_RETENTION_DAYS,
        "nav_section": "activity",
        **_filters(chosen),
    }
    return render_page(request, principal, "frontend/activity.html", context)


def _detail_texts(details: dict[str, Any]) -> list[str]:
    """``name: value`` per detail; a change as ``name: old → new`` (None shows as "none",
    the quota's "unlimited")."""

    def plain(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, list):
            return ", ".join(str(v) for v in value)
        return str(value)

    texts = []
    for name, value in details.items():
        if isinstance(value, dict) and set(value) == {"old", "new"}:
            texts.append(f"{name}: {plain(value['old'])} → {plain(value['new'])}")
        else:
            texts.append(f"{name}: {plain(value)}")
    return texts


def _filters(chosen: str) -> dict[str, Any]:
    return {"actions": list(Action.choices), "chosen_action": chosen}
