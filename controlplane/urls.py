from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.sandboxes.views_reports import metrics
from controlplane.version_view import VersionView


def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("healthz", health, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("reports/", include("apps.sandboxes.urls_reports")),
    path("admin/", admin.site.urls),
    path("api/v1/version", VersionView.as_view(), name="version"),
    path("api/v1/", include("apps.sandboxes.api.urls")),
    path("api/v1/", include("apps.tenancy.api.urls")),
    path("api/v1/", include("apps.billing.api.urls")),
    path("api/v1/", include("apps.datasets.api.urls")),  # before trajectories: episodes/matrix
    path("api/v1/", include("apps.trajectories.api.urls")),
    path("api/v1/", include("apps.images.api.urls")),
    path("orchard/", include("apps.orchard.urls")),
    path("e2b/", include("apps.e2b.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("trajectories/", include("apps.trajectories.urls")),
    path("datasets/", include("apps.datasets.urls")),
    path("billing/", include("apps.billing.urls")),
    path("images/", include("apps.images.urls")),
    path("", include("frontend.urls")),
]

# JSON for API paths (unknown endpoint, unexpected failure), Django's pages elsewhere.
handler404 = "apps.core.errors.not_found"
handler500 = "apps.core.errors.server_error"
