"""Long-lived sockets re-check the credential they were opened with.

A websocket authenticates once, at the handshake; without this a revoked key (or a
removed member, a disabled team, a signed-out session) would keep an open terminal
for as long as the socket lives. Every HEDGEROW_WS_REVALIDATE_S seconds each socket
runs one query by primary key (the key, or the membership joined with the session)
and closes when the answer changed (docs/realtime.md: close codes 4401 and 4403).

Why polling and not a revocation broadcast: the credential can stop being valid
without any Hedgerow code path running (an expiry time passing, the Django admin, a
SQL fix), and a broadcast missed during a reconnect is a terminal that stays open. A
primary-key lookup every few seconds per socket is cheap (1,000 open sockets at the
default interval are 200 indexed lookups a second spread over the web processes) and
catches every cause with one code path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from django.conf import settings
from django.contrib.sessions.models import Session
from django.db import DatabaseError
from django.db.models import Exists
from django.utils import timezone

from apps.core.asyncdb import db_async
from apps.tenancy.auth import ROLE_SCOPES
from apps.tenancy.models import ApiKey, Membership
from apps.tenancy.principal import Principal

log = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401  # the credential no longer authenticates
CLOSE_FORBIDDEN = 4403  # it still does, with other scopes or another role


@dataclass(frozen=True)
class Lost:
    code: str
    message: str
    close_code: int


def principal_lost(principal: Principal, session_key: str | None) -> Lost | None:
    """Why the principal a socket opened with no longer holds, or None (one query)."""
    now = timezone.now()
    if principal.api_key is not None:
        row = (
            ApiKey.objects.filter(pk=principal.api_key.pk)
            .values_list(
                "revoked_at",
                "expires_at",
                "tenant__is_active",
                "scopes",
                "secret_hash",
                "previous_secret_hash",
                "previous_valid_until",
            )
            .first()
        )
        if row is None or row[0] is not None:
            return Lost("api_key_revoked", "this API key was revoked", CLOSE_UNAUTHENTICATED)
        _revoked_at, expires_at, tenant_active, scopes, current, previous, grace_end = row
        if expires_at is not None and expires_at <= now:
            return Lost("api_key_expired", "this API key has expired", CLOSE_UNAUTHENTICATED)
        digest = principal.secret_digest
        in_grace = digest == previous and grace_end is not None and grace_end > now
        if digest and digest != current and not in_grace:
            return Lost(
                "api_key_rotated",
                "this API key's secret was rotated and its grace period is over",
                CLOSE_UNAUTHENTICATED,
            )
        if not tenant_active:
            return Lost("tenant_disabled", "this team is disabled", CLOSE_UNAUTHENTICATED)
        if frozenset(scopes) != principal.scopes:
            return Lost(
                "permissions_changed", "this key's scopes changed; reconnect", CLOSE_FORBIDDEN
            )
        return None
    if principal.user is None:
        return Lost("not_authenticated", "no credential", CLOSE_UNAUTHENTICATED)
    # The session check is a subquery of the same statement: one round trip.
    live_session = Session.objects.filter(session_key=session_key or "", expire_date__gt=now)
    member = (
        Membership.objects.filter(user_id=principal.user.pk, tenant_id=principal.tenant.pk)
        .annotate(session_live=Exists(live_session))
        .values_list("role", "tenant__is_active", "user__is_active", "session_live")
        .first()
    )
    if member is None:
        return Lost(
            "membership_removed",
            "you are no longer a member of this team",
            CLOSE_UNAUTHENTICATED,
        )
    role, tenant_active, user_active, session_live = member
    if not tenant_active:
        return Lost("tenant_disabled", "this team is disabled", CLOSE_UNAUTHENTICATED)
    if not user_active or not session_live:
        return Lost("session_ended", "this session has ended; sign in again", CLOSE_UNAUTHENTICATED)
    if ROLE_SCOPES.get(role, frozenset()) != principal.scopes:
        return Lost("permissions_changed", "your role changed; reconnect", CLOSE_FORBIDDEN)
    return None


_principal_lost = db_async(principal_lost)


async def watch_principal(
    principal: Principal,
    session_key: str | None,
    *,
    closed: Callable[[], bool],
    on_lost: Callable[[Lost], Awaitable[None]],
) -> None:
    """Runs until the socket closes: re-checks every HEDGEROW_WS_REVALIDATE_S seconds
    and calls ``on_lost`` once when the credential stopped holding. A failed check (the
    database unreachable) is logged and retried at the next interval."""
    interval = settings.HEDGEROW_WS_REVALIDATE_S
    while not closed():
        await asyncio.sleep(interval)
        if closed():
            return
        try:
            lost = await _principal_lost(principal, session_key)
        except DatabaseError:
            log.warning("websocket credential check failed; retrying", exc_info=True)
            continue
        if lost is not None:
            await on_lost(lost)
            return
