"""Alert notifications (issue 24): a crossed alert or budget is recorded once per month
(a notice and a ``budget.crossed`` activity entry), shown as a banner on the dashboard
while it holds, and POSTed to the webhook the owners set — by a Celery task, with a
timeout, to a loopback receiver these tests start — with the URL (which may hold a
token) never shown back, logged or written to the activity log."""

from __future__ import annotations

import json
import logging
import socket
import threading
from datetime import timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.billing import notices, tasks
from apps.billing.models import BudgetNotice, TenantQuota
from apps.billing.quotas import quota_get
from apps.billing.tests.test_costs import book, ledger_sandbox  # noqa: F401 - fixture
from apps.tenancy.models import Action, Activity
from apps.tenancy.services import membership_set_role

pytestmark = pytest.mark.django_db
TOKEN = "s3cr3t-hook-token"


def _client(tenant, name: str, role: str) -> Client:
    user = User.objects.create_user(name, password="pw")
    membership_set_role(tenant=tenant, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def _spend_an_hour(tenant) -> None:
    """An hour of 2 vCPU + 4 GiB this month: $0.29 with the test price book."""
    ledger_sandbox(
        tenant, timezone.now() - timedelta(hours=2), [("provisioning", 0), ("deleted", 3600)]
    )


def _set(tenant, **values: Any) -> None:
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(**values)


class Receiver:
    """A loopback HTTP server that records each POST (path, headers, JSON body)."""

    def __init__(self, status: int = 204) -> None:
        received: list[dict[str, Any]] = []
        self.received = received
        self.arrived = threading.Event()

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                received.append(
                    {
                        "path": self.path,
                        "type": self.headers.get("Content-Type"),
                        "body": json.loads(self.rfile.read(length)),
                    }
                )
                self.send_response(status)
                self.end_headers()
                outer.arrived.set()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/{TOKEN}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_a_crossing_is_recorded_once_a_month_and_shown_on_the_dashboard(
    make_tenant,
    book,  # noqa: F811
):
    tenant, _ = make_tenant()
    quiet, _ = make_tenant()
    _set(tenant, budget_alert=Decimal("0.25"), team_budget=Decimal("0.25"))
    _set(quiet, budget_alert=Decimal("100"))
    owner = _client(tenant, "nina", "owner")
    assert 'id="budget-notices"' not in owner.get("/sandboxes/").content.decode()
    _spend_an_hour(tenant)  # $0.29

    assert notices.notices_check() == []  # no webhook set: nothing to deliver
    assert notices.notices_check() == []  # and nothing recorded twice
    rows = BudgetNotice.objects.filter(tenant=tenant).order_by("kind")
    assert [(n.kind, n.threshold, n.spent, n.webhook) for n in rows] == [
        ("alert", Decimal("0.25"), Decimal("0.29"), ""),
        ("team_budget", Decimal("0.25"), Decimal("0.29"), ""),
    ]
    entries = Activity.objects.filter(tenant=tenant, action=Action.BUDGET_CROSSED)
    assert sorted(e.details["kind"] for e in entries) == ["alert", "team_budget"]
    assert all(e.actor == "system" and e.details["spent"] == "0.29" for e in entries)
    assert not BudgetNotice.objects.filter(tenant=quiet).exists()

    page = owner.get("/sandboxes/").content.decode()
    assert 'id="budget-notices"' in page
    assert "has reached the team&#x27;s spending alert of $0.25." in page
    assert "has reached the monthly budget the team&#x27;s owners set of $0.25." in page
    assert "New sandboxes are refused" in page
    # the activity page names it
    assert "crossed" in owner.get("/activity/").content.decode()

    # raised above the spend: that banner goes, the alert's stays
    _set(tenant, team_budget=Decimal("50"))
    page = owner.get("/sandboxes/").content.decode()
    assert 'data-kind="alert"' in page and 'data-kind="team_budget"' not in page
    assert "New sandboxes are refused" not in page
    # another team sees none of it
    other = _client(quiet, "quinn", "owner")
    assert 'id="budget-notices"' not in other.get("/sandboxes/").content.decode()


def test_last_months_notice_does_not_hide_this_months(make_tenant, book):  # noqa: F811
    tenant, _ = make_tenant()
    _set(tenant, budget_alert=Decimal("0.10"))
    _spend_an_hour(tenant)
    last_month = (timezone.now().replace(day=1) - timedelta(days=1)).strftime("%Y-%m")
    BudgetNotice.objects.create(
        tenant=tenant, kind="alert", period=last_month, threshold=1, spent=2
    )
    notices.notices_check(tenant=tenant)
    periods = sorted(BudgetNotice.objects.filter(tenant=tenant).values_list("period", flat=True))
    assert periods == [last_month, notices.period_of(timezone.now())]


def test_the_webhook_gets_one_post_and_its_url_is_never_shown_or_logged(
    make_tenant,
    book,  # noqa: F811
    receiver,
    settings,
    caplog,
):
    settings.HEDGEROW_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is on loopback
    tenant, _ = make_tenant()
    owner = _client(tenant, "wade", "owner")
    set_ = owner.post("/billing/usage/webhook", {"alert_webhook_url": receiver.url})
    assert set_.status_code == 302 and set_["Location"] == "/billing/usage/"
    assert quota_get(tenant=tenant).alert_webhook_url == receiver.url
    page = owner.get("/billing/usage/").content.decode()
    assert "Webhook set." in page and "A webhook is set" in page and TOKEN not in page
    owner.post("/billing/usage/budget", {"team_budget": "0.20"})
    _spend_an_hour(tenant)

    caplog.set_level(logging.DEBUG)
    ids = notices.notices_check(tenant=tenant)
    assert len(ids) == 1
    assert BudgetNotice.objects.get(pk=ids[0]).webhook == "pending"
    outcome = tasks.budget_webhook_post.apply(args=(ids[0],)).get()
    assert outcome == "delivered 204"
    assert receiver.arrived.is_set() and len(receiver.received) == 1
    post = receiver.received[0]
    assert post["path"] == f"/hooks/{TOKEN}" and post["type"] == "application/json"
    assert post["body"]["event"] == "budget.crossed"
    assert (post["body"]["team"], post["body"]["kind"]) == (tenant.slug, "team_budget")
    assert (post["body"]["threshold"], post["body"]["spent"]) == ("0.20", "0.29")
    assert BudgetNotice.objects.get(pk=ids[0]).webhook == "delivered 204"
    # delivered once: a second run of the task sends nothing more
    assert tasks.budget_webhook_post.apply(args=(ids[0],)).get() == "delivered 204"
    assert notices.notices_check(tenant=tenant) == []
    assert len(receiver.received) == 1
    # no token anywhere a person reads
    assert TOKEN not in caplog.text
    for entry in Activity.objects.filter(tenant=tenant):
        assert TOKEN not in json.dumps(entry.details) and TOKEN not in entry.target_name
    export = owner.get("/api/v1/activity/export?output=jsonl")
    assert export.status_code == 200
    assert TOKEN not in export.getvalue().decode()


def test_a_webhook_that_never_answers_times_out(make_tenant, book, settings):  # noqa: F811
    settings.HEDGEROW_WEBHOOK_ALLOW_PRIVATE = True
    settings.HEDGEROW_WEBHOOK_TIMEOUT_S = 0.5
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection into its backlog, never answers
    try:
        tenant, _ = make_tenant()
        _set(
            tenant,
            budget_alert=Decimal("0.10"),
            alert_webhook_url=f"http://127.0.0.1:{silent.getsockname()[1]}/{TOKEN}",
        )
        _spend_an_hour(tenant)
        (notice_id,) = notices.notices_check(tenant=tenant)
        assert notices.webhook_deliver(notice_id=notice_id) == "failed: timed out"
        assert BudgetNotice.objects.get(pk=notice_id).webhook == "failed: timed out"
    finally:
        silent.close()


def test_a_private_address_is_refused_unless_allowed(
    make_tenant,
    book,  # noqa: F811
    receiver,
    settings,
):
    settings.HEDGEROW_WEBHOOK_ALLOW_PRIVATE = False
    tenant, _ = make_tenant()
    _set(tenant, budget_alert=Decimal("0.10"), alert_webhook_url=receiver.url)
    _spend_an_hour(tenant)
    (notice_id,) = notices.notices_check(tenant=tenant)
    outcome = notices.webhook_deliver(notice_id=notice_id)
    assert outcome == "failed: the webhook's host is not a public address"
    assert receiver.received == []


def test_the_webhook_form_refuses_bad_urls_without_echoing_and_members_cannot_set_it(
    make_tenant,
):
    tenant, _ = make_tenant()
    owner = _client(tenant, "vera", "owner")
    bad = f"ftp://h.example/{TOKEN}"
    refused = owner.post("/billing/usage/webhook", {"alert_webhook_url": bad})
    assert refused.status_code == 200
    html = refused.content.decode()
    assert 'id="e-alert-webhook">Enter an http:// or https:// URL' in html
    assert TOKEN not in html
    assert quota_get(tenant=tenant).alert_webhook_url == ""
    member = _client(tenant, "mo", "member")
    assert (
        member.post(
            "/billing/usage/webhook", {"alert_webhook_url": "https://h.example/"}
        ).status_code
        == 403
    )
    assert quota_get(tenant=tenant).alert_webhook_url == ""
    # removing it
    owner.post("/billing/usage/webhook", {"alert_webhook_url": "https://h.example/x"})
    assert owner.post("/billing/usage/webhook", {"alert_webhook_url": ""}).status_code == 302
    assert quota_get(tenant=tenant).alert_webhook_url == ""
    assert "No webhook is set." in owner.get("/billing/usage/").content.decode()


def test_the_django_admin_never_shows_the_webhook(make_tenant):
    tenant, _ = make_tenant()
    _set(tenant, alert_webhook_url=f"https://h.example/{TOKEN}")
    User.objects.create_superuser("root-w", password="pw")
    staff = Client()
    staff.force_login(User.objects.get(username="root-w"))
    quota = quota_get(tenant=tenant)
    for url in (
        f"/admin/billing/tenantquota/{quota.pk}/change/",
        f"/admin/tenancy/tenant/{tenant.pk}/change/",
    ):
        page = staff.get(url)
        assert page.status_code == 200, url
        assert (
            TOKEN not in page.content.decode() and "alert_webhook_url" not in page.content.decode()
        )
