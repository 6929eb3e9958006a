from django.urls import path

from apps.datasets import views

app_name = "datasets"

urlpatterns = [
    path("", views.dataset_list_page, name="list"),
    path("create", views.dataset_create_page, name="create"),
    path("matrix", views.matrix_page, name="matrix"),
    path("<str:dataset_id>/", views.dataset_card_page, name="card"),
]
