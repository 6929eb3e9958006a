"""The team activity log entry a staff quota edit writes (the API and the Django admin)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from apps.billing.quotas import quota_get
from apps.tenancy.models import Activity

pytestmark = pytest.mark.django_db


def test_a_staff_quota_edit_is_logged_with_old_and_new_values(make_tenant, client):
    tenant, _ = make_tenant()
    staff = User.objects.create_user("root", password="root", is_staff=True)
    http = APIClient()
    http.force_login(staff)
    patched = http.patch(
        f"/api/v1/admin/tenants/{tenant.slug}/quota",
        {"max_concurrent_sandboxes": 7},
        format="json",
    )
    assert patched.status_code == 200, patched.content
    again = http.patch(
        f"/api/v1/admin/tenants/{tenant.slug}/quota",
        {"max_concurrent_sandboxes": 7},
        format="json",
    )
    assert again.status_code == 200  # no change: no second entry
    entries = list(Activity.objects.filter(tenant=tenant, action="quota.changed"))
    assert [(e.actor, e.target_name) for e in entries] == [("staff:root", "team limits")]
    assert entries[0].details["max_concurrent_sandboxes"]["new"] == 7
    assert quota_get(tenant=tenant).max_concurrent_sandboxes == 7

    # the Django admin's list edits go through the same service
    client.force_login(User.objects.create_superuser("boss", password="boss"))
    quota = quota_get(tenant=tenant)
    listed = client.post(
        "/admin/billing/tenantquota/",
        {
            "form-TOTAL_FORMS": "1",
            "form-INITIAL_FORMS": "1",
            "form-0-id": str(quota.pk),
            "form-0-max_concurrent_sandboxes": "9",
            "form-0-monthly_budget": "",
            "form-0-queue_by_default": "",
            "_save": "Save",
        },
    )
    assert listed.status_code == 302, listed.content[:2000]
    latest = Activity.objects.filter(tenant=tenant, action="quota.changed").order_by("-id")[0]
    assert latest.actor == "staff:boss"
    assert latest.details["max_concurrent_sandboxes"] == {"old": 7, "new": 9}
    assert quota_get(tenant=tenant).max_concurrent_sandboxes == 9
