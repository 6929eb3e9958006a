"""Who is looking at a page: the signed-in user acting for the session's current team.

Pages resolve the same Principal the API builds for a browser session
(``principal_for_session``), so a page and the REST call it makes always agree on the
team and on what the role may do. Role checks happen here, on the server; templates
only hide what the server would refuse anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse

from apps.core.errors import NotFound
from apps.core.nav import NAV_ITEMS
from apps.tenancy.auth import principal_for_session
from apps.tenancy.principal import Principal
from apps.tenancy.selectors import teams_of_user

View = Callable[..., HttpResponse]


def staff_page(view: View) -> View:
    """Decorates a staff page (cost report, leak report): anonymous users are sent to
    the admin sign-in (staff sign in there); a signed-in user who is not staff gets a
    styled 403 with a way back, not a sign-in form that cannot help them."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path(), reverse("admin:login"))
        if not (request.user.is_active and getattr(request.user, "is_staff", False)):
            return render(request, "frontend/staff_only.html", status=403)
        return view(request, *args, **kwargs)

    return wrapper


def page(scope: str = "read") -> Callable[[View], View]:
    """Decorates a dashboard view: signed in, in a team, and holding ``scope``."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            principal = principal_for_session(request.user, request.session.get("tenant_id"))
            if principal is None:
                return render(request, "frontend/no_team.html", status=403)
            if request.session.get("tenant_id") != str(principal.tenant.pk):
                request.session["tenant_id"] = str(principal.tenant.pk)
            if not principal.has_scope(scope):
                return render_page(
                    request,
                    principal,
                    "frontend/forbidden.html",
                    {"needed": scope},
                    status=403,
                )
            try:
                return view(request, principal, *args, **kwargs)
            except NotFound as exc:
                # Another team's object does not exist for this user: a 404, as in the API.
                raise Http404(exc.message) from exc

        return wrapper

    return decorate


def nav_entries(principal: Principal) -> list[dict[str, str]]:
    entries = []
    for item in NAV_ITEMS:
        if not principal.has_scope(item.scope):
            continue
        try:
            url = reverse(item.url_name)
        except NoReverseMatch:
            continue
        entries.append({"label": item.label, "url": url, "section": item.section})
    return entries


def render_page(
    request: HttpRequest,
    principal: Principal,
    template: str,
    context: dict[str, Any] | None = None,
    *,
    status: int = 200,
) -> HttpResponse:
    """Renders a dashboard page with what base.html needs (team, role, nav; the
    websocket paths come from ``controlplane.context_processors``)."""
    user = request.user
    teams = list(teams_of_user(user=user)) if user.is_authenticated else []
    base = {
        "principal": principal,
        "tenant": principal.tenant,
        "role": principal.role,
        "can_write": principal.has_scope("write"),
        "can_admin": principal.has_scope("admin"),
        "teams": teams,
        "nav": nav_entries(principal),
    }
    return render(request, template, {**base, **(context or {})}, status=status)


def is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"
