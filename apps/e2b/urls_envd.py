"""``/e2b/envd/…``: envd's API (E2B_SANDBOX_URL), paths exactly as the SDK calls them."""

from django.urls import path, re_path

from apps.e2b import envd, views

urlpatterns = [
    path("health", envd.health, name="e2b-envd-health"),
    path("files", envd.files_http, name="e2b-envd-files"),
    path("process.Process/<str:method>", envd.process_rpc, name="e2b-envd-process"),
    path("filesystem.Filesystem/<str:method>", envd.filesystem_rpc, name="e2b-envd-fs"),
    re_path(r"^(?P<path>.*)$", views.not_found),
]
