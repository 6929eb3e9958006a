"""Directory watchers in a sandbox, over its agent (podagent/watch.py): a watcher
reports what changed under a directory since the last read (create, remove, write,
chmod, rename; names relative to it), a read waiting up to ``wait`` seconds for a
change. Watchers live in the agent: at most 16 per sandbox, 10000 entries each, gone
with the sandbox (or after 10 idle minutes)."""

from __future__ import annotations

import re
from typing import Any

from apps.core.errors import ApiError, NotFound, ValidationFailed
from apps.sandboxes.agent_client import AgentError, AgentUnreachable
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services.files import _check_path
from apps.sandboxes.services.operations import AgentUnavailable, agent_for, ensure_ready

WATCHER_ID = re.compile(r"w-[0-9a-f]{32}\Z")
MAX_WAIT_S = 60.0


def _call(
    sandbox: Sandbox,
    method: str,
    endpoint: str,
    params: dict[str, Any] | None = None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    ensure_ready(sandbox)
    try:
        response = agent_for(sandbox).request(method, endpoint, params=params, timeout=timeout)
    except AgentError as exc:
        if exc.status == 404 and endpoint.startswith("/watchers/"):
            raise NotFound(exc.message, code="watcher_not_found", field="watcher_id") from exc
        raise ApiError(
            exc.message, code=exc.code, field=exc.field or "path", status_code=exc.status
        ) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    return result


def _watcher_path(watcher_id: str) -> str:
    if not WATCHER_ID.match(watcher_id or ""):
        raise NotFound("no such watcher", code="watcher_not_found", field="watcher_id")
    return f"/watchers/{watcher_id}"


def watcher_create(
    *, sandbox: Sandbox, path: str | None, recursive: bool, include_entry: bool = False
) -> dict[str, Any]:
    """Starts watching a directory: ``{watcher_id, path, recursive, include_entry,
    entries}``. With ``include_entry`` each event of a name that exists after the look
    carries its ``entry`` (the file entry a stat answers)."""
    params = {"path": _check_path(path), "recursive": "1" if recursive else "0"}
    if include_entry:
        params["include_entry"] = "1"
    return _call(sandbox, "POST", "/watchers", params, timeout=30.0)


def watcher_events(*, sandbox: Sandbox, watcher_id: str, wait: Any = 0) -> dict[str, Any]:
    """What changed since the last read, waiting up to ``wait`` s (≤ 60) for a change:
    ``{watcher_id, events: [{name, type, entry?}]}``."""
    try:
        seconds = float(wait or 0)
    except (TypeError, ValueError):
        raise ValidationFailed("wait must be a number of seconds", field="wait") from None
    if not 0 <= seconds <= MAX_WAIT_S:
        raise ValidationFailed(f"wait must be 0 to {MAX_WAIT_S:g} seconds", field="wait")
    endpoint = _watcher_path(watcher_id)
    return _call(sandbox, "GET", endpoint, {"wait": seconds}, timeout=seconds + 30.0)


def watcher_delete(*, sandbox: Sandbox, watcher_id: str) -> dict[str, Any]:
    return _call(sandbox, "DELETE", _watcher_path(watcher_id))
