from django.urls import path

from apps.tenancy.api import views

urlpatterns = [
    path("keys", views.ApiKeyListCreateView.as_view(), name="apikey-list"),
    path("keys/<str:key_id>", views.ApiKeyDetailView.as_view(), name="apikey-detail"),
    path("keys/<str:key_id>/rotate", views.ApiKeyRotateView.as_view(), name="apikey-rotate"),
    # the team's activity log (not /audits: those are sandbox leak audits)
    path("activity", views.ActivityListView.as_view(), name="activity-list"),
    path("activity/export", views.ActivityExportView.as_view(), name="activity-export"),
]
