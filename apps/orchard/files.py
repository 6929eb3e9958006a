"""Orchard file calls (base64 in JSON) and apply_patch, over the Hedgerow file and
exec services."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from django.conf import settings

from apps.core.errors import ApiError, ValidationFailed
from apps.sandboxes.api.serializers import render_stream
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services import files
from apps.sandboxes.services.patching import sandbox_apply_patch
from apps.tenancy.principal import Principal

# Base64 in a JSON body is held in memory on both sides; bigger files go through
# Hedgerow's streamed /api/v1 files endpoints.
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024
# The upload's JSON body: the file in base64 (4 characters per 3 bytes) plus the path
# and the JSON around them.
MAX_UPLOAD_BODY = 4 * -(-MAX_JSON_FILE_BYTES // 3) + 64 * 1024


def _decode(content: Any) -> bytes:
    if not isinstance(content, str):
        raise ValidationFailed("content must be a base64 string", field="content")
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValidationFailed("content is not valid base64", field="content") from exc


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationFailed("path is required", field="path")
    return value


def file_upload(*, sandbox: Sandbox, path: Any, content: Any) -> dict[str, Any]:
    data = _decode(content)
    limit = min(int(settings.HEDGEROW_MAX_UPLOAD_BYTES), MAX_JSON_FILE_BYTES)
    result = files.file_write(
        sandbox=sandbox, path=_path(path), chunks=iter([data]), size=len(data), max_bytes=limit
    )
    return {"success": True, "path": result.get("path", path), "size": result.get("size")}


def file_download(*, sandbox: Sandbox, path: Any) -> dict[str, Any]:
    """A symlink is followed inside the sandbox (as the streamed download does); the
    size check is on what the agent opened, before its body is read."""
    target = _path(path)
    data = files.file_open(sandbox=sandbox, path=target).read_all(MAX_JSON_FILE_BYTES)
    return {"path": target, "content": base64.b64encode(data).decode(), "size": len(data)}


def file_listing(*, sandbox: Sandbox, path: Any, limit: Any, cursor: Any) -> dict[str, Any]:
    """Orchard's shape (``path``, ``files``), one page of up to ``limit`` entries
    (default and max: files.LIST_LIMIT_MAX); ``next_cursor`` is null when ``files``
    holds the rest of the directory."""
    listing = files.file_list(
        sandbox=sandbox,
        path=path if isinstance(path, str) else None,
        limit=files.LIST_LIMIT_MAX if limit in (None, "") else limit,
        cursor=cursor if isinstance(cursor, str) else None,
    )
    entries = []
    for entry in listing["entries"]:
        kind = entry.get("type")
        entries.append(
            {
                "name": entry.get("name"),
                "path": entry.get("path"),
                # Orchard knows files and directories; a symlink is listed as a file
                # (not followed), with its target.
                "type": "directory" if kind == "directory" else "file",
                "size": int(entry.get("size") or 0),
                "modified": entry.get("modified"),
                "mode": entry.get("mode"),
                "target": entry.get("target"),
            }
        )
    return {
        "path": listing.get("path") or path,
        "files": entries,
        "next_cursor": listing["next_cursor"],
    }


def patch_apply(
    *, principal: Principal, sandbox: Sandbox, patch: Any, timeout: Any, cwd: Any
) -> dict[str, Any]:
    """Writes the patch to a temporary file in the sandbox and applies it with
    ``git apply`` (or ``patch``) in ``cwd`` (default /workspace), as a recorded
    operation. A patch that does not apply is ``success: false`` with the tool's
    output, not an HTTP error."""
    if not isinstance(patch, str) or not patch.strip():
        raise ValidationFailed("patch must be a non-empty string", field="patch")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise ValidationFailed("cwd must be an absolute path", field="cwd")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise ValidationFailed("timeout_seconds must be a positive number", field="timeout_seconds")
    try:
        operation = sandbox_apply_patch(
            principal=principal,
            sandbox=sandbox,
            patch=patch,
            cwd=cwd,
            timeout=float(timeout) if timeout is not None else None,
        )
    except ApiError as exc:
        return {"success": False, "stdout": "", "stderr": "", "exit_code": None, "error": str(exc)}
    ok = operation.termination == "exited" and operation.exit_code == 0
    error = None
    if not ok:
        error = operation.termination if operation.termination != "exited" else "patch failed"
    return {
        "success": ok,
        "stdout": render_stream(operation.stdout),
        "stderr": render_stream(operation.stderr),
        "exit_code": operation.exit_code,
        "error": error,
        "operation_id": operation.operation_id,
    }
