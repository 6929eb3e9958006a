"""``/orchard/…``: the Orchard Env REST API (paths exactly as the Orchard SDK calls them)."""

from django.urls import path, re_path

from apps.orchard import views

urlpatterns = [
    path("health", views.health, name="orchard-health"),
    path("resources", views.resources, name="orchard-resources"),
    path("sandboxes", views.sandbox_create, name="orchard-sandboxes"),
    path("sandboxes/<str:sandbox_id>", views.sandbox_detail, name="orchard-sandbox"),
    path("sandboxes/<str:sandbox_id>/wait", views.sandbox_wait, name="orchard-sandbox-wait"),
    path(
        "sandboxes/<str:sandbox_id>/heartbeat",
        views.sandbox_heartbeat_view,
        name="orchard-sandbox-heartbeat",
    ),
    path("sandboxes/<str:sandbox_id>/exec", views.sandbox_exec, name="orchard-exec"),
    path("sandboxes/<str:sandbox_id>/apply_patch", views.apply_patch, name="orchard-patch"),
    path("sandboxes/<str:sandbox_id>/files", views.sandbox_files, name="orchard-files"),
    path(
        "sandboxes/<str:sandbox_id>/files/list",
        views.sandbox_files_list,
        name="orchard-files-list",
    ),
    path("jobs/<str:job_id>", views.job_detail, name="orchard-job"),
    path("jobs/<str:job_id>/wait", views.job_wait, name="orchard-job-wait"),
    # Everything else under the prefix is a JSON 404, never the dashboard's HTML.
    re_path(r"^(?P<path>.*)$", views.not_found),
]
