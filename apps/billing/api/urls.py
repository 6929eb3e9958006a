from django.urls import path

from apps.billing.api import usage_views

urlpatterns = [
    path("quota", usage_views.QuotaView.as_view(), name="quota"),
    path("usage", usage_views.UsageView.as_view(), name="usage"),
    path("budget", usage_views.BudgetView.as_view(), name="budget"),
    path("price-books", usage_views.PriceBookListView.as_view(), name="price-books"),
    path(
        "admin/tenants/<slug:slug>/quota",
        usage_views.AdminTenantQuotaView.as_view(),
        name="admin-tenant-quota",
    ),
    path("admin/cost-report", usage_views.AdminCostReportView.as_view(), name="admin-cost-report"),
]
