"""Server-rendered billing pages (the browser tests drive the same pages in Chromium)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.billing.models import TenantQuota
from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import T0, book, ledger_sandbox  # noqa: F401 - fixture
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db


def test_it_shows_a_team_its_own_usage_budget_and_hosted_comparison(
    make_tenant,
    client,
    book,  # noqa: F811
):
    tenant, _ = make_tenant()
    outsider, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        monthly_budget=Decimal("50.00"), max_concurrent_sandboxes=10
    )
    ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", 3600)], image="python")
    ledger_sandbox(outsider, T0, [("provisioning", 0), ("deleted", 7200)], image="secret-img")
    user = User.objects.create_user("ana", password="pw")
    membership_set_role(tenant=tenant, user=user, role="viewer")
    client.force_login(user)
    page = client.get("/billing/usage/", {"start": "2026-03-01", "end": "2026-03-31"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "$0.29" in html and "python" in html and "secret-img" not in html
    assert "$50.00" in html and 'data-provider="modal"' in html
    assert 'data-quota="concurrent_sandboxes"' in html
    assert client.get("/billing/usage/", {"start": "nonsense"}).status_code == 200


def test_it_keeps_the_cost_report_for_staff_and_sorts_it(
    make_tenant,
    client,
    book,  # noqa: F811
):
    a, _ = make_tenant()
    b, _ = make_tenant()
    ledger_sandbox(a, T0, [("provisioning", 0), ("deleted", 7200)])
    ledger_sandbox(b, T0, [("provisioning", 0), ("deleted", 3600)])
    member = User.objects.create_user("ana", password="pw")
    client.force_login(member)
    refused = client.get("/billing/staff/costs/")  # signed in, not staff: a way back
    assert refused.status_code == 403 and 'id="staff-only"' in refused.content.decode()
    assert Client().get("/billing/staff/costs/")["Location"].startswith("/admin/login/")
    staff = User.objects.create_user("root", password="pw", is_staff=True)
    client.force_login(staff)
    window = {"start": "2026-03-01", "end": "2026-04-01"}
    ascending = client.get("/billing/staff/costs/", {**window, "sort": "cost"}).content.decode()
    assert ascending.index(f'data-tenant="{b.slug}"') < ascending.index(f'data-tenant="{a.slug}"')
    descending = client.get("/billing/staff/costs/", {**window, "sort": "-cost"}).content.decode()
    assert descending.index(f'data-tenant="{a.slug}"') < descending.index(f'data-tenant="{b.slug}"')
    assert "hedgerow v2" in descending
    csv = client.get("/billing/staff/costs/", {**window, "output": "csv"})
    assert csv["Content-Type"].startswith("text/csv")
    assert csv.content.decode().splitlines()[1].startswith(f"{a.slug},1,2.0000")


def test_it_renders_quota_bars_anywhere_a_tenant_is_in_context(make_tenant):
    from django.template import Context, Template

    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=4)
    html = Template("{% load billing %}{% quota_bars %}").render(Context({"tenant": tenant}))
    assert 'data-quota="concurrent_sandboxes"' in html and "0 / 4" in html


def test_it_shows_quota_use_bars_on_the_sandboxes_page(make_tenant, client):
    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_cpu_millis=8000)
    user = User.objects.create_user("ana", password="pw")
    membership_set_role(tenant=tenant, user=user, role="member")
    client.force_login(user)
    html = client.get("/sandboxes/").content.decode()
    assert 'data-quota="cpu_millis"' in html and "0m / 8000m" in html


def test_it_shows_a_queued_sandbox_with_its_position_and_a_delete_button(
    make_tenant, client, no_enqueue
):
    from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create

    tenant, _ = make_tenant()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=0)
    queued, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(image="host", cpu_millis=500, memory_mib=256, queue=True),
        idempotency_key=None,
        actor="user:ana",
    )
    assert queued.state == "queued"
    user = User.objects.create_user("ana", password="pw")
    membership_set_role(tenant=tenant, user=user, role="member")
    client.force_login(user)
    table = client.get("/sandboxes/").content.decode()
    assert "#1 in the queue" in table
    assert f"/sandboxes/{queued.external_id}/delete" in table
    detail = client.get(f"/sandboxes/{queued.external_id}/").content.decode()
    assert "#1 in the admission queue" in detail


def test_images_and_labels_are_charted_apart(
    make_tenant,
    client,
    book,  # noqa: F811
):
    """Issue 24, defect 11: one chart mixed image references and label pairs on one axis."""
    tenant, _ = make_tenant()
    ledger_sandbox(tenant, T0, [("provisioning", 0), ("deleted", 3600)], image="python")
    user = User.objects.create_user("cal", password="pw")
    membership_set_role(tenant=tenant, user=user, role="viewer")
    client.force_login(user)
    page = client.get("/billing/usage/", {"start": "2026-03-01", "end": "2026-03-31"})
    images, labels = page.context["image_chart"], page.context["label_chart"]
    assert images["labels"] == ["python"]
    assert "python" not in labels["labels"]
    assert all("=" in label for label in labels["labels"])
    html = page.content.decode()
    assert "Cost by image<" in html and "Cost by label<" in html
    assert "Cost by image and label" not in html
