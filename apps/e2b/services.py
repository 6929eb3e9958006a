"""E2B sandboxes on top of Hedgerow's own lifecycle services.

Nothing here changes state by itself: creates, deletes and expiry changes go through
``apps.sandboxes.services.lifecycle`` (quotas, ledger, idempotency and the state
machine all apply); this module translates E2B's request and response shapes.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

from django.conf import settings
from django.db import transaction

from apps.core import crypto, jsonsafe
from apps.core.errors import ApiError, Conflict, NotFound, ValidationFailed
from apps.e2b.models import SandboxEnv
from apps.e2b.tokens import envd_token
from apps.sandboxes.backends import get_backend
from apps.sandboxes.exec_env import ENV_REDACTED
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.selectors import page_limit, sandbox_keyset_page
from apps.sandboxes.services.lifecycle import (
    SandboxRequest,
    sandbox_create,
    sandbox_delete,
    sandbox_set_expiry,
    validate_labels,
)
from apps.sandboxes.services.waiting import sandbox_wait_settled
from apps.tenancy.principal import Principal

# What the answers say envd is: the SDK turns features on by this version (stdin,
# close_stdin and the default user from 0.5.2 on, octet-stream uploads from 0.5.7,
# file metadata from 0.6.2, watch events with entry info from 0.6.3). File metadata
# (X-Metadata-* upload headers) is refused with a 400 by the upload view; watching
# network mounts (0.6.4) stays off in the SDK itself.
ENVD_VERSION = "0.6.3"
CLIENT_ID = "hedgerow"
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox lifetime
DEFAULT_CPU_MILLIS = 1000
DEFAULT_MEMORY_MIB = 1024
# Body fields of POST /v2/sandboxes that Hedgerow cannot honour yet: a typed 400
# rather than a sandbox that silently lacks them.
UNSUPPORTED = {
    "autoPause": "auto-pause needs snapshots, which Hedgerow does not have yet",
    "autoResume": "auto-resume needs snapshots, which Hedgerow does not have yet",
    "mcp": "MCP servers in the sandbox are not supported",
    "network": "per-sandbox network rules are not supported (allow_internet_access is)",
    "volumeMounts": "volumes are not supported",
    "iam": "workload identity is not supported",
}


class TemplateNotFound(NotFound):
    code = "template_not_found"


def template_image(template: Any) -> str:
    """E2B's template → a Hedgerow image. E2B's SDK default ``base`` is the image
    HEDGEROW_E2B_BASE_IMAGE names; any other template must be an image this backend
    has, by its exact name. An unknown one is a 404 that lists what exists, never a
    stand-in."""
    if not isinstance(template, str) or not template.strip() or len(template) > 200:
        raise ValidationFailed("templateID must be a non-empty string", field="templateID")
    names = {image.name for image in get_backend().images()}
    image = settings.HEDGEROW_E2B_BASE_IMAGE if template == "base" else template
    if image not in names:
        raise TemplateNotFound(
            f"template {template!r} not found; templates are Hedgerow images: "
            f"{', '.join(sorted(names))}",
            field="templateID",
        )
    return str(image)


def _strings(data: dict[str, Any], name: str) -> dict[str, str]:
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValidationFailed(f"{name} must map strings to strings", field=name)
    return dict(value)


def _timeout(value: Any) -> int:
    if value is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValidationFailed("timeout must be a positive number of seconds", field="timeout")
    if value > settings.HEDGEROW_MAX_TTL_S:
        raise ValidationFailed(
            f"timeout must be at most {settings.HEDGEROW_MAX_TTL_S} seconds", field="timeout"
        )
    return int(value)


def _idempotency_key(raw: str | None) -> str | None:
    """The SDK's Idempotency-Key (1-255 of [a-z0-9-]), namespaced so it never meets a
    REST key, and hashed when it would not fit the column."""
    if not raw:
        return None
    if len(raw) > 100:
        return "e2b:" + hashlib.sha256(raw.encode()).hexdigest()
    return "e2b:" + raw


def e2b_create_request(data: dict[str, Any]) -> SandboxRequest:
    """Validates a POST /v2/sandboxes body into a Hedgerow create request."""
    for name, reason in UNSUPPORTED.items():
        value = data.get(name)
        if value not in (None, False, [], {}):
            raise ValidationFailed(reason, field=name, code="not_supported")
    internet = data.get("allow_internet_access")
    if internet is not None and not isinstance(internet, bool):
        raise ValidationFailed(
            "allow_internet_access must be true or false", field="allow_internet_access"
        )
    timeout = _timeout(data.get("timeout"))
    return SandboxRequest(
        image=template_image(data.get("templateID")),
        cpu_millis=DEFAULT_CPU_MILLIS,
        memory_mib=DEFAULT_MEMORY_MIB,
        # Omitted: Hedgerow's default (no network), not E2B's (docs/e2b.md).
        network_access=bool(internet),
        ttl_seconds=timeout,
        labels=validate_labels(_strings(data, "metadata")),
    )


def e2b_sandbox_create(
    *, principal: Principal, data: dict[str, Any], idempotency_key: str | None
) -> Sandbox:
    """Creates a sandbox and answers once it is ready, as E2B does (its SDK talks to
    envd straight after). One that does not become ready in time is deleted and the
    create fails: nothing is left half-created."""
    request = e2b_create_request(data)
    env = _strings(data, "envVars")
    jsonsafe.require_no_nul(env, "envVars")
    with transaction.atomic():
        sandbox, created = sandbox_create(
            tenant=principal.tenant,
            request=request,
            idempotency_key=_idempotency_key(idempotency_key),
            actor=principal.actor,
        )
        if created and env:
            SandboxEnv.objects.create(
                sandbox=sandbox,
                env=dict.fromkeys(env, ENV_REDACTED),
                env_sealed=crypto.encrypt(json.dumps(env)),
            )
        elif not created and sandbox_env(sandbox) != env:
            raise Conflict(
                "this idempotency key was used for a different sandbox request",
                field="idempotency_key",
                code="idempotency_mismatch",
            )
    sandbox = sandbox_wait_settled(sandbox=sandbox, timeout_s=settings.HEDGEROW_E2B_CREATE_WAIT_S)
    if sandbox.state == State.READY:
        sandbox_env(sandbox)  # cached now: the envd fast path serves its first command
    if sandbox.state != State.READY:
        state, message = sandbox.state, sandbox.status_message
        with transaction.atomic():
            sandbox_delete(sandbox=sandbox, actor=principal.actor, reason="e2b_create_failed")
        raise ApiError(
            f"the sandbox did not become ready ({state}{': ' + message if message else ''})",
            code="sandbox_not_ready",
            status_code=504
            if state in (State.QUEUED, State.REQUESTED, State.PROVISIONING)
            else 500,
        )
    return sandbox


# sandbox pk → its envVars. They are written once, in the create's transaction, and
# never change, so a process keeps what it read (the envd fast path reads only this).
_env_cache: dict[str, dict[str, str]] = {}
ENV_CACHE_MAX = 10000


def sandbox_env(sandbox: Sandbox) -> dict[str, str]:
    """The sandbox's envVars ({} when none were given)."""
    cached = _env_cache.get(str(sandbox.pk))
    if cached is not None:
        return dict(cached)
    row = SandboxEnv.objects.filter(sandbox=sandbox).first()
    env: dict[str, str] = (
        json.loads(crypto.decrypt(row.env_sealed)) if row is not None and row.env_sealed else {}
    )
    if sandbox.state == State.READY:  # its create has committed: the env is final
        if len(_env_cache) >= ENV_CACHE_MAX:
            _env_cache.clear()
        _env_cache[str(sandbox.pk)] = env
    return dict(env)


def sandbox_env_cached(sandbox_pk: str) -> dict[str, str] | None:
    """The envVars this process has read for the sandbox, or None."""
    cached = _env_cache.get(sandbox_pk)
    return None if cached is None else dict(cached)


def e2b_sandbox_get(*, principal: Principal, sandbox_id: str) -> Sandbox:
    """The tenant's live sandbox; another tenant's, or one that ended, is not found."""
    sandbox = (
        Sandbox.objects.for_tenant(principal.tenant)
        .filter(external_id=sandbox_id)
        .exclude(state__in=(State.TERMINATING, State.DELETED, State.FAILED, State.LOST))
        .first()
    )
    if sandbox is None:
        raise NotFound(f"sandbox {sandbox_id!r} not found", code="sandbox_not_found")
    return sandbox


def e2b_sandbox_kill(*, principal: Principal, sandbox_id: str) -> None:
    sandbox = e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    with transaction.atomic():
        sandbox_delete(sandbox=sandbox, actor=principal.actor)


def e2b_sandbox_set_timeout(*, principal: Principal, sandbox_id: str, timeout: Any) -> None:
    """E2B's timeout is from now: the sandbox ends ``timeout`` seconds later."""
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise ValidationFailed("timeout must be a whole number of seconds", field="timeout")
    sandbox = e2b_sandbox_get(principal=principal, sandbox_id=sandbox_id)
    sandbox_set_expiry(sandbox=sandbox, seconds=timeout)


def metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK's ``metadata`` query value: ``k=v&k2=v2``, each key and value quoted
    once more before the whole is URL-encoded."""
    if not raw:
        return {}
    pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=False)
    return {unquote(k): unquote(v) for k, v in pairs}


DEFAULT_LIST_LIMIT = 100  # E2B's page size when the SDK sends none


def e2b_sandbox_list(
    *,
    principal: Principal,
    metadata: str | None,
    state: str | None,
    limit: str | None = None,
    next_token: str | None = None,
    order: str | None = None,
    template: str | None = None,
    started_after: str | None = None,
) -> tuple[list[Sandbox], str | None]:
    """One page of the tenant's running and/or paused sandboxes (``state``; both when
    not given, as E2B) and the token of the next (None on the last): keyset pages on
    (created_at, id), oldest first unless ``order=desc``, so a sandbox created or
    killed while the SDK pages never repeats or hides another."""
    states = {s for s in (state or "running,paused").split(",") if s}
    if not states <= {"running", "paused"}:
        raise ValidationFailed("state must be running and/or paused", field="state")
    size = page_limit(limit, default=DEFAULT_LIST_LIMIT)
    if order not in (None, "", "asc", "desc"):
        raise ValidationFailed("order must be asc or desc", field="order")
    rows: list[str] = []
    if "running" in states:
        rows += [State.QUEUED, State.REQUESTED, State.PROVISIONING, State.READY]
    if "paused" in states:
        rows.append(State.PAUSED)
    queryset = Sandbox.objects.for_tenant(principal.tenant).filter(state__in=rows)
    wanted = metadata_filter(metadata)
    if wanted:
        queryset = queryset.filter(labels__contains=wanted)
    if template:
        image = settings.HEDGEROW_E2B_BASE_IMAGE if template == "base" else template
        queryset = queryset.filter(image=image)
    if started_after:
        try:
            after = datetime.fromisoformat(started_after.replace("Z", "+00:00"))
        except ValueError:
            raise ValidationFailed(
                "startedAfter must be an ISO 8601 time", field="startedAfter"
            ) from None
        if after.tzinfo is None:
            after = after.replace(tzinfo=UTC)
        queryset = queryset.filter(created_at__gte=after)
    try:
        return sandbox_keyset_page(
            queryset, cursor=next_token, limit=size, newest_first=order == "desc"
        )
    except ValidationFailed as exc:
        raise ValidationFailed(
            "nextToken is not a token this server gave", field="nextToken"
        ) from exc


def _iso(value: Any) -> str:
    return str(value.isoformat().replace("+00:00", "Z"))


def _common(sandbox: Sandbox) -> dict[str, Any]:
    template = "base" if sandbox.image == settings.HEDGEROW_E2B_BASE_IMAGE else sandbox.image
    return {
        "templateID": template,
        "sandboxID": sandbox.external_id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
    }


def sandbox_created_view(sandbox: Sandbox, *, principal: Principal) -> dict[str, Any]:
    """The ``Sandbox`` shape (create and connect)."""
    view = _common(sandbox)
    token = envd_token(principal=principal, sandbox_pk=sandbox.pk)
    if token is not None:
        view["envdAccessToken"] = token
    return view


def sandbox_listed_view(sandbox: Sandbox) -> dict[str, Any]:
    """The ``ListedSandbox`` shape."""
    return {
        **_common(sandbox),
        "startedAt": _iso(sandbox.ready_at or sandbox.created_at),
        "endAt": _iso(sandbox.expires_at),
        "cpuCount": max(1, math.ceil(sandbox.cpu_millis / 1000)),
        "memoryMB": sandbox.memory_mib,
        "diskSizeMB": 0,
        "state": "paused" if sandbox.state == State.PAUSED else "running",
        "metadata": dict(sandbox.labels or {}),
    }


def sandbox_detail_view(sandbox: Sandbox, *, principal: Principal) -> dict[str, Any]:
    """The ``SandboxDetail`` shape."""
    view = sandbox_listed_view(sandbox)
    view["allowInternetAccess"] = sandbox.network_access
    token = envd_token(principal=principal, sandbox_pk=sandbox.pk)
    if token is not None:
        view["envdAccessToken"] = token
    return view
