from django.urls import path

from apps.tenancy.api import views

urlpatterns = [
    path("keys", views.ApiKeyListCreateView.as_view(), name="apikey-list"),
    path("keys/<str:key_id>", views.ApiKeyDetailView.as_view(), name="apikey-detail"),
]
