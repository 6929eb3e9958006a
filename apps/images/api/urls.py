from django.urls import path

from apps.images.api import views

urlpatterns = [
    path("images", views.ImageListCreateView.as_view(), name="image-list"),
    # before images/<id>: "import" is not an id
    path("images/import", views.ImageImportView.as_view(), name="image-import"),
    path("images/<str:image_id>", views.ImageDetailView.as_view(), name="image-detail"),
    path(
        "registry-credentials",
        views.RegistryCredentialListCreateView.as_view(),
        name="registry-credential-list",
    ),
    path(
        "registry-credentials/<str:credential_id>",
        views.RegistryCredentialDetailView.as_view(),
        name="registry-credential-detail",
    ),
]
