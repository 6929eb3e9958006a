from django.urls import path

from apps.billing import views

app_name = "billing"

urlpatterns = [
    path("usage/", views.usage_page, name="usage"),
    path("usage/alert", views.budget_alert_view, name="budget-alert"),
    path("usage/budget", views.team_budget_view, name="team-budget"),
    path("usage/webhook", views.alert_webhook_view, name="alert-webhook"),
    path("staff/costs/", views.cost_report_page, name="cost-report"),
]
