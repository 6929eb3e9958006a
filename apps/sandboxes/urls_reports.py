from django.urls import path

from apps.sandboxes import views_reports

urlpatterns = [
    path("leaks", views_reports.leak_report, name="leak-report"),
    path("leaks/run", views_reports.leak_report_run, name="leak-report-run"),
    path("leaks.json", views_reports.leak_report_json, name="leak-report-json"),
    path("leaks/mine", views_reports.tenant_leaks, name="tenant-leaks"),
]
