"""The team activity log: the writes (``activity_record``, called by the services that
create/revoke/rename/rotate keys, change members, delete sandboxes and change quotas),
the reads (a keyset page, an export stream) and the retention purge. Nothing secret
is ever written here: a key is named by its name and prefix."""

from __future__ import annotations

import base64
import csv
import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from apps.core.errors import ValidationFailed
from apps.tenancy.models import Action, Activity, Tenant

EXPORT_FIELDS = ["at", "actor", "action", "target_type", "target_id", "target_name", "details"]


def activity_record(
    *,
    tenant: Tenant | str | uuid.UUID,
    actor: str,
    action: Action,
    target_type: str,
    target_id: str,
    target_name: str = "",
    details: dict[str, Any] | None = None,
) -> Activity:
    """Appends one entry. Call it inside the transaction of the change it records, so
    the entry exists exactly when the change does."""
    tenant_id = tenant.pk if isinstance(tenant, Tenant) else tenant
    return Activity.objects.create(
        tenant_id=tenant_id,
        actor=(actor or "system")[:200],
        action=action,
        target_type=target_type,
        target_id=str(target_id)[:64],
        target_name=target_name[:200],
        details=details or {},
    )


def activity_list(
    *,
    tenant: Tenant,
    action: str | None = None,
    actor: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[Activity]:
    """The team's entries, newest first, filtered. An unknown action is a 400."""
    qs = Activity.objects.filter(tenant=tenant)
    if action:
        if action not in Action.values:
            raise ValidationFailed(
                f"unknown action {action!r}; one of {', '.join(Action.values)}", field="action"
            )
        qs = qs.filter(action=action)
    if actor:
        qs = qs.filter(actor=actor)
    if since is not None:
        qs = qs.filter(at__gte=since)
    if until is not None:
        qs = qs.filter(at__lt=until)
    return qs.order_by("-id")


@dataclass(frozen=True)
class ActivityPage:
    rows: list[Activity]
    next_cursor: str | None


def _encode(pk: int) -> str:
    return base64.urlsafe_b64encode(f"a{pk}".encode()).decode().rstrip("=")


def _decode(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if raw[:1] == "a" and raw[1:].isdigit():
            return int(raw[1:])
    except (ValueError, UnicodeDecodeError):
        pass
    raise ValidationFailed("cursor is not one this API returned", field="cursor")


def activity_page(qs: QuerySet[Activity], *, cursor: str | None, limit: int) -> ActivityPage:
    """A keyset page on the id (entries are append-only, so pages never shift)."""
    if cursor:
        qs = qs.filter(id__lt=_decode(cursor))
    rows = list(qs.order_by("-id")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return ActivityPage(rows, _encode(rows[-1].pk) if more else None)


def activity_as_dict(entry: Activity) -> dict[str, Any]:
    return {
        "id": entry.pk,
        "at": entry.at.isoformat(),
        "actor": entry.actor,
        "action": entry.action,
        "target_type": entry.target_type,
        "target_id": entry.target_id,
        "target_name": entry.target_name,
        "details": entry.details,
    }


def activity_export(qs: QuerySet[Activity], *, fmt: str) -> Iterator[str]:
    """The entries as CSV (a header row, details as JSON) or JSON Lines, streamed in
    chunks of rows. The same fields as the API; no secrets exist to leak."""
    if fmt not in ("csv", "jsonl"):
        raise ValidationFailed("output must be csv or jsonl", field="output")
    return _export_rows(qs, fmt)


def _export_rows(qs: QuerySet[Activity], fmt: str) -> Iterator[str]:
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(EXPORT_FIELDS)
        yield buffer.getvalue()
    for entry in qs.order_by("-id").iterator(chunk_size=500):
        row = activity_as_dict(entry)
        if fmt == "jsonl":
            yield json.dumps({k: row[k] for k in EXPORT_FIELDS}, sort_keys=True) + "\n"
            continue
        buffer = io.StringIO()
        csv.writer(buffer).writerow(
            [
                json.dumps(row[k], sort_keys=True) if k == "details" else row[k]
                for k in EXPORT_FIELDS
            ]
        )
        yield buffer.getvalue()


MAX_PAGE = 500


def page_limit(raw: str | None, *, default: int = 50) -> int:
    """A page size from a query parameter: 1…MAX_PAGE, else a typed 400."""
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise ValidationFailed(f"limit must be an integer from 1 to {MAX_PAGE}", field="limit")
    return int(raw)


def parse_instant(raw: str | None, *, field: str) -> datetime | None:
    """An ISO 8601 time (a date means its midnight UTC) from a query parameter, or a
    typed 400."""
    if raw is None or raw == "":
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise ValidationFailed(f"{field} must be an ISO 8601 time", field=field) from None
    if timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value


def activity_purge(*, now: datetime | None = None) -> int:
    """Deletes entries older than HEDGEROW_ACTIVITY_RETENTION_DAYS (celery beat, daily).
    Returns how many went."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.HEDGEROW_ACTIVITY_RETENTION_DAYS)
    deleted, _ = Activity.objects.filter(at__lt=cutoff).delete()
    return deleted
