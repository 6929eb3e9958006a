"""File I/O through the agent, streamed both ways (no whole-file buffering)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from apps.billing.limits import upload_admit, upload_record
from apps.sandboxes.agent_client import AgentError, AgentUnreachable
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services.operations import AgentUnavailable, agent_for, ensure_ready
from controlplane.errors import ApiError

CHUNK = 256 * 1024


def _check_path(path: str | None) -> str:
    if not path:
        raise ApiError("path is required", field="path", code="path_required")
    if not path.startswith("/"):
        raise ApiError("path must be absolute", field="path", code="path_not_absolute")
    return path


def _translate(exc: AgentError) -> ApiError:
    return ApiError(exc.message, code=exc.code, field=exc.field or "path", status_code=exc.status)


def file_write(
    *,
    sandbox: Sandbox,
    path: str | None,
    chunks: Iterator[bytes],
    size: int | None,
    max_bytes: int,
    mode: str | None = None,
) -> dict[str, Any]:
    """Streams bytes to an atomic write in the sandbox. Over ``max_bytes`` → 413, no file."""
    ensure_ready(sandbox)
    target = _check_path(path)
    # Quotas (billing): the team's per-upload maximum and bytes per day (413 / 429).
    max_bytes = upload_admit(tenant_id=str(sandbox.tenant_id), size=size, max_bytes=max_bytes)
    if size is not None and size > max_bytes:
        raise ApiError(
            f"upload of {size} bytes exceeds the limit of {max_bytes}",
            code="too_large",
            status_code=413,
            extra={"limit": "max_upload_bytes", "value": max_bytes, "current": size},
        )
    params: dict[str, Any] = {"path": target, "max_bytes": max_bytes}
    if mode:
        params["mode"] = mode
    headers = {"Content-Length": str(size)} if size is not None else None
    try:
        response = agent_for(sandbox).request(
            "PUT", "/files", params=params, content=chunks, headers=headers, timeout=600
        )
    except AgentError as exc:
        raise _translate(exc) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    if size is None:  # a streamed upload of unknown length counts once its size is known
        upload_record(tenant_id=str(sandbox.tenant_id), nbytes=int(result.get("size") or 0))
    return result


def _agent_json(sandbox: Sandbox, path: str, endpoint: str) -> dict[str, Any]:
    ensure_ready(sandbox)
    try:
        response = agent_for(sandbox).request("GET", endpoint, params={"path": _check_path(path)})
    except AgentError as exc:
        raise _translate(exc) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    return result


def file_list(*, sandbox: Sandbox, path: str | None) -> dict[str, Any]:
    return _agent_json(sandbox, path or "/workspace", "/files/list")


def file_stat(*, sandbox: Sandbox, path: str | None) -> dict[str, Any]:
    return _agent_json(sandbox, _check_path(path), "/files/stat")


async def file_read_stream(*, sandbox: Sandbox, path: str) -> AsyncIterator[bytes]:
    """Yields the file's bytes as the agent sends them (used by async streaming responses)."""
    agent = agent_for(sandbox)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(60.0)) as client:
        async with client.stream(
            "GET", agent.base + "/files", params={"path": path}, headers=agent._headers()
        ) as response:
            if response.status_code >= 400:
                return
            async for chunk in response.aiter_raw(CHUNK):
                yield chunk
