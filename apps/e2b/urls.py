"""``/e2b/…``: the E2B control-plane API (paths exactly as the E2B SDK calls them)."""

from django.urls import include, path, re_path

from apps.e2b import views

urlpatterns = [
    path("envd/", include("apps.e2b.urls_envd")),
    path("v2/sandboxes", views.sandboxes, name="e2b-sandboxes"),
    path("sandboxes", views.sandboxes, name="e2b-sandboxes-v1"),
    path("sandboxes/<str:sandbox_id>", views.sandbox_detail, name="e2b-sandbox"),
    path("sandboxes/<str:sandbox_id>/timeout", views.sandbox_timeout, name="e2b-timeout"),
    path("v2/sandboxes/<str:sandbox_id>/connect", views.sandbox_connect, name="e2b-connect"),
    path("sandboxes/<str:sandbox_id>/connect", views.sandbox_connect, name="e2b-connect-v1"),
    path("sandboxes/<str:sandbox_id>/pause", views.sandbox_pause, name="e2b-pause"),
    path("sandboxes/<str:sandbox_id>/resume", views.sandbox_connect, name="e2b-resume"),
    path("sandboxes/<str:sandbox_id>/snapshots", views.not_yet, name="e2b-snapshots"),
    path("sandboxes/<str:sandbox_id>/fork", views.not_yet, name="e2b-fork"),
    # Everything else under the prefix is E2B's JSON 404, never the dashboard's HTML.
    re_path(r"^(?P<path>.*)$", views.not_found),
]
