"""The Images page: the team's images with live pull progress, a pull form, delete with
confirmation, and the team's registry logins (passwords never leave the server).

Reads and writes go through ``apps.images.services``, as the REST API does, so the page
shows the API's typed errors (``image_in_use``, ``registry_unauthorized`` …) as they are.
Every form is post/redirect/get: a reload never pulls or stores twice.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.core import keyset
from apps.core.errors import ApiError
from apps.images import services
from apps.images.models import ImageStatus, RegistryCredential
from apps.tenancy.pages import page, render_page
from apps.tenancy.principal import Principal

IMAGES_PAGE = 50  # images per page (cursor pages, newest first, like the sandboxes list)


def _images_context(principal: Principal, cursor: str = "") -> dict[str, Any]:
    all_images = services.image_list(tenant=principal.tenant)
    page_ = keyset.newest_first(all_images, cursor=cursor, limit=IMAGES_PAGE)
    return {
        "images": page_.rows,
        "cursor": cursor,
        "next_cursor": page_.next_cursor,
        # any pull of the team, on this page or not: the table keeps re-reading until
        # none runs, so a pull on another page still shows its end when paged to
        "pulling": all_images.filter(status=ImageStatus.PULLING).exists(),
    }


def _page_context(principal: Principal, cursor: str = "") -> dict[str, Any]:
    return {
        **_images_context(principal, cursor),
        "credentials": list(RegistryCredential.objects.for_tenant(principal.tenant)),
        "form": {},
        "errors": {},
        "cred_form": {},
        "cred_errors": {},
        "nav_section": "images",
    }


@require_http_methods(["GET", "POST"])
@page()
def image_list_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    """GET lists; POST (writers) asks for a pull: access is proved now, so a bad
    reference or a refused login is shown by the field and nothing is recorded."""
    context = _page_context(principal, request.GET.get("cursor", ""))
    if request.method == "POST":
        if not principal.has_scope("write"):
            return render_page(
                request, principal, "frontend/forbidden.html", {"needed": "write"}, status=403
            )
        reference = request.POST.get("reference", "").strip()
        try:
            image, started = services.image_pull_request(
                tenant=principal.tenant, reference=reference
            )
        except ApiError as exc:
            context.update(
                form={"reference": reference},
                errors={"reference": exc.message, "code": exc.code},
            )
            # 200 like the other forms: the page with the error is the answer.
            return render_page(request, principal, "images/list.html", context)
        verb = "Pulling" if started else "Already pulling"
        messages.success(request, f"{verb} {image.reference}.")
        return redirect("images:list")
    return render_page(request, principal, "images/list.html", context)


@require_GET
@page()
def image_table(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The images table alone, re-read when a pull ends (and polled while one runs
    without a realtime socket)."""
    return render_page(
        request,
        principal,
        "images/_table.html",
        _images_context(principal, request.GET.get("cursor", "")),
    )


@require_POST
@page("write")
def image_delete_view(request: HttpRequest, principal: Principal, image_id: str) -> HttpResponse:
    image = services.image_get(tenant=principal.tenant, image_id=image_id)
    try:
        services.image_delete(tenant=principal.tenant, image=image)
    except ApiError as exc:
        if exc.code != "image_in_use":
            raise
        count = int(getattr(image, "live_sandboxes", 0) or 0)
        messages.error(
            request,
            f"{image.reference} was not deleted: {count or 'a'} live "
            f"sandbox{'es' if count > 1 else ''} use{'s' if count <= 1 else ''} it. "
            "Delete those sandboxes first.",
        )
    else:
        messages.success(request, f"Deleted {image.reference}.")
    return redirect("images:list")


@require_POST
@page("write")
def credential_add(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Stores (or replaces) the team's login for a registry host. The password is
    encrypted at rest and never rendered back, not even into the form after an error."""
    data = {k: request.POST.get(k, "").strip() for k in ("registry", "username")}
    try:
        cred = services.credential_create(
            tenant=principal.tenant,
            registry=data["registry"],
            username=data["username"],
            password=request.POST.get("password", ""),
        )
    except ApiError as exc:
        context = _page_context(principal)
        context.update(cred_form=data, cred_errors={exc.field or "form": exc.message})
        return render_page(request, principal, "images/list.html", context)
    messages.success(request, f"Stored the login {cred.username}@{cred.registry}.")
    return redirect("images:list")


@require_POST
@page("write")
def credential_delete_view(
    request: HttpRequest, principal: Principal, credential_id: str
) -> HttpResponse:
    cred = services.credential_get(tenant=principal.tenant, credential_id=credential_id)
    services.credential_delete(credential=cred)
    messages.success(request, f"Deleted the login for {cred.registry}.")
    return redirect("images:list")
