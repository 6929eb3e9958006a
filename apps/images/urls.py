from django.urls import path

from apps.images import views

app_name = "images"

urlpatterns = [
    path("", views.image_list_page, name="list"),
    path("table", views.image_table, name="table"),
    path("credentials", views.credential_add, name="credential-add"),
    path(
        "credentials/<str:credential_id>/delete",
        views.credential_delete_view,
        name="credential-delete",
    ),
    path("<str:image_id>/delete", views.image_delete_view, name="delete"),
]
