"""The file browser's writes (issue 24, defect 6): delete a file or directory, or make
a folder, then show the directory it happened in — the browser keeps its place."""

from __future__ import annotations

import posixpath

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from apps.core.errors import ApiError
from apps.sandboxes import selectors
from apps.sandboxes.services import files
from apps.tenancy.pages import page
from apps.tenancy.principal import Principal
from frontend.views import files_listing


@require_POST
@page("write")
def sandbox_file_delete(
    request: HttpRequest, principal: Principal, sandbox_id: str
) -> HttpResponse:
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    path = request.POST.get("path", "")
    recursive = request.POST.get("recursive") == "1"
    parent = posixpath.dirname(path.rstrip("/")) or "/"
    try:
        files.file_delete(sandbox=sandbox, path=path, recursive=recursive)
    except ApiError as exc:
        return files_listing(request, principal, sandbox, parent, action_error=exc.message)
    return files_listing(request, principal, sandbox, parent, message=f"Deleted {path}.")


@require_GET
@page("write")
def sandbox_file_exists(
    request: HttpRequest, principal: Principal, sandbox_id: str
) -> HttpResponse:
    """{"exists": bool} for the upload box's overwrite check: always a 200 (a 404 from
    the stat API would be a console error in every browser for the common case)."""
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    try:
        entry = files.file_stat(sandbox=sandbox, path=request.GET.get("path", ""))
    except ApiError as exc:
        if exc.status_code == 404:
            return JsonResponse({"exists": False})
        return JsonResponse({"error": {"code": exc.code, "message": exc.message}}, status=400)
    return JsonResponse({"exists": True, "type": entry.get("type")})


@require_POST
@page("write")
def sandbox_file_mkdir(request: HttpRequest, principal: Principal, sandbox_id: str) -> HttpResponse:
    """A new folder ``name`` in the directory shown (one path segment: no "/")."""
    sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
    directory = request.POST.get("dir", "") or "/workspace"
    name = request.POST.get("name", "").strip()
    if not name or "/" in name or name in (".", ".."):
        return files_listing(
            request,
            principal,
            sandbox,
            directory,
            action_error="Give the folder a name (no slashes), e.g. data.",
        )
    path = posixpath.join(directory, name)
    try:
        files.file_mkdir(sandbox=sandbox, path=path)
    except ApiError as exc:
        return files_listing(request, principal, sandbox, directory, action_error=exc.message)
    return files_listing(request, principal, sandbox, directory, message=f"Created {path}/.")
