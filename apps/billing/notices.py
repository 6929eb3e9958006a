"""Budget notices: when a team's month-to-date spend reaches its owners' alert, their
own hard budget or staff's budget, that is recorded once per UTC month (a
``BudgetNotice`` row and a ``budget.crossed`` activity entry, one transaction), shown
as a banner on the dashboard, and POSTed to the webhook the owners set, if any.

``notices_check`` is run by a beat task every ``HEDGEROW_BUDGET_NOTICE_INTERVAL_S``;
``webhook_deliver`` by a task per notice. The webhook's URL may carry a token: it is
never logged, shown back or written to the activity log (only whether one is set).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from datetime import datetime
from decimal import Decimal
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from apps.billing.models import BudgetNotice, BudgetNoticeKind, TenantQuota
from apps.billing.pricing import money
from apps.billing.reports import month_to_date_cost
from apps.tenancy.activity import activity_record
from apps.tenancy.models import Action, Tenant

log = logging.getLogger(__name__)

KIND_TEXT = {
    BudgetNoticeKind.ALERT: "the team's spending alert",
    BudgetNoticeKind.TEAM_BUDGET: "the monthly budget the team's owners set",
    BudgetNoticeKind.MONTHLY_BUDGET: "the team's monthly budget (set by staff)",
}


def period_of(at: datetime) -> str:
    return f"{at:%Y-%m}"


def notices_check(*, tenant: Tenant | None = None, now: datetime | None = None) -> list[int]:
    """Records each threshold this month's spend has reached and that has no notice yet
    this month (of every team with one set, or of ``tenant``). Returns the ids of the new
    notices whose team has a webhook (the caller enqueues their delivery)."""
    now = now or timezone.now()
    quotas = TenantQuota.objects.select_related("tenant").filter(
        Q(budget_alert__isnull=False)
        | Q(team_budget__isnull=False)
        | Q(monthly_budget__isnull=False)
    )
    if tenant is not None:
        quotas = quotas.filter(tenant=tenant)
    to_deliver: list[int] = []
    for quota in quotas:
        thresholds = {
            BudgetNoticeKind.ALERT: quota.budget_alert,
            BudgetNoticeKind.TEAM_BUDGET: quota.team_budget,
            BudgetNoticeKind.MONTHLY_BUDGET: quota.monthly_budget,
        }
        spent = month_to_date_cost(tenant=quota.tenant, now=now)
        for kind, threshold in thresholds.items():
            if threshold is None or spent < threshold:
                continue
            notice = _record(quota=quota, kind=kind, threshold=threshold, spent=spent, now=now)
            if notice is not None and notice.webhook == "pending":
                to_deliver.append(notice.pk)
    return to_deliver


def _record(
    *,
    quota: TenantQuota,
    kind: BudgetNoticeKind,
    threshold: Decimal,
    spent: Decimal,
    now: datetime,
) -> BudgetNotice | None:
    """The notice and its activity entry, or None when this month already has one."""
    period = period_of(now)
    if BudgetNotice.objects.filter(tenant=quota.tenant, kind=kind, period=period).exists():
        return None
    try:
        with transaction.atomic():
            notice = BudgetNotice.objects.create(
                tenant=quota.tenant,
                kind=kind,
                period=period,
                threshold=threshold,
                spent=money(spent),
                at=now,
                webhook="pending" if quota.alert_webhook_url else "",
            )
            activity_record(
                tenant=quota.tenant,
                actor="system",
                action=Action.BUDGET_CROSSED,
                target_type="quota",
                target_id=str(quota.tenant_id),
                target_name=str(kind.label),
                details={
                    "kind": str(kind),
                    "period": period,
                    "threshold": str(threshold),
                    "spent": str(money(spent)),
                },
            )
    except IntegrityError:  # a concurrent check recorded it first
        return None
    return notice


def notices_current(
    *, tenant: Tenant, now: datetime | None = None, spent: Decimal | None = None
) -> list[dict[str, str]]:
    """This month's notices of ``tenant`` that still hold (the threshold was not since
    raised or cleared above the spend), for the dashboard banner, newest first.
    ``spent``: the month to date when the caller read it already (the usage page)."""
    now = now or timezone.now()
    rows = list(
        BudgetNotice.objects.filter(tenant=tenant, period=period_of(now)).order_by("-at", "-id")
    )
    if not rows:
        return []
    quota = TenantQuota.objects.filter(tenant=tenant).first()
    if spent is None:
        spent = month_to_date_cost(tenant=tenant, now=now)
    out = []
    for n in rows:
        kind = BudgetNoticeKind(n.kind)
        threshold = getattr(quota, "budget_alert" if kind == BudgetNoticeKind.ALERT else kind)
        if threshold is None or spent < threshold:
            continue
        out.append(
            {
                "kind": n.kind,
                "text": f"This month's spend (${money(spent):,.2f}) has reached "
                f"{KIND_TEXT[kind]} of ${threshold:,.2f}.",
                "refuses": "" if kind == BudgetNoticeKind.ALERT else "yes",
                "at": n.at.isoformat(),
            }
        )
    return out


class WebhookRefused(Exception):
    """The webhook's URL points where the control plane does not POST."""


def webhook_target(url: str) -> None:
    """Refuses a URL whose host resolves to a loopback, private, link-local or otherwise
    internal address (the control plane must not be a way into its own network), unless
    ``HEDGEROW_WEBHOOK_ALLOW_PRIVATE`` (development, the tests' loopback receiver)."""
    host = urlsplit(url).hostname or ""
    if settings.HEDGEROW_WEBHOOK_ALLOW_PRIVATE:
        return
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise WebhookRefused("the webhook's host does not resolve") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            raise WebhookRefused("the webhook's host is not a public address")


def webhook_deliver(*, notice_id: int) -> str:
    """POSTs one notice to its team's webhook (JSON, no redirects followed, a timeout)
    and records the outcome on the notice: "delivered <status>" or "failed: <why>"."""
    notice = BudgetNotice.objects.select_related("tenant").filter(pk=notice_id).first()
    if notice is None or notice.webhook != "pending":
        return notice.webhook if notice else "gone"
    quota = TenantQuota.objects.filter(tenant=notice.tenant).first()
    url = quota.alert_webhook_url if quota else ""
    if not url:
        outcome = "failed: no webhook is set"
    else:
        payload = {
            "event": "budget.crossed",
            "team": notice.tenant.slug,
            "kind": notice.kind,
            "period": notice.period,
            "threshold": str(notice.threshold),
            "spent": str(notice.spent),
            "at": notice.at.isoformat(),
        }
        try:
            webhook_target(url)
            response = httpx.post(
                url,
                json=payload,
                timeout=settings.HEDGEROW_WEBHOOK_TIMEOUT_S,
                follow_redirects=False,
                headers={"User-Agent": "hedgerow-budget-notice"},
            )
            outcome = (
                f"delivered {response.status_code}"
                if 200 <= response.status_code < 300
                else f"failed: HTTP {response.status_code}"
            )
        except WebhookRefused as exc:
            outcome = f"failed: {exc}"
        except httpx.TimeoutException:
            outcome = "failed: timed out"
        except httpx.HTTPError as exc:
            outcome = f"failed: {type(exc).__name__}"  # never the URL (it may hold a token)
    BudgetNotice.objects.filter(pk=notice.pk).update(webhook=outcome[:200])
    # The team and the notice, never the URL.
    log.info("budget notice %s of %s: webhook %s", notice.pk, notice.tenant.slug, outcome)
    return outcome
