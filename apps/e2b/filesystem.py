"""envd's filesystem on Hedgerow's file and exec services.

Reads, writes, listings and stats go to the agent's file endpoints
(``apps.sandboxes.services.files``, streamed both ways); making a directory, moving and
removing are commands (``mkdir -p``, ``mv``, ``rm -rf``) run through ``operation_exec``,
so each is an operation row like any other command.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import stat as stat_module
import uuid
from collections.abc import Iterator
from typing import Any

from apps.core.errors import ApiError
from apps.e2b.connect import ConnectError, envelope
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services import file_watch, files
from apps.sandboxes.services.operations import ExecRequest, operation_exec
from apps.tenancy.principal import Principal

MAX_DEPTH = 8
_TYPES = {
    "file": "FILE_TYPE_FILE",
    "directory": "FILE_TYPE_DIRECTORY",
    "symlink": "FILE_TYPE_SYMLINK",
}
_KIND_BITS = {
    "file": stat_module.S_IFREG,
    "directory": stat_module.S_IFDIR,
    "symlink": stat_module.S_IFLNK,
}


def path_of(value: Any, field: str = "path") -> str:
    """An absolute path (Hedgerow has no per-user home to resolve a relative one in)."""
    if not isinstance(value, str) or not value:
        raise ConnectError("invalid_argument", f"{field} is required")
    if not value.startswith("/"):
        raise ConnectError("invalid_argument", f"{field} must be absolute, got {value!r}")
    return value


def entry_info(entry: dict[str, Any]) -> dict[str, Any]:
    """An agent file entry → envd's EntryInfo (proto3 JSON)."""
    kind = str(entry.get("type") or "")
    perm = int(str(entry.get("mode") or "0"), 8)
    modified = dt.datetime.fromtimestamp(float(entry.get("modified") or 0), tz=dt.UTC)
    info: dict[str, Any] = {
        "name": entry.get("name") or "",
        "type": _TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": entry.get("path") or "",
        "size": str(int(entry.get("size") or 0)),
        "mode": perm,
        "permissions": stat_module.filemode(_KIND_BITS.get(kind, 0) | perm),
        "owner": "",
        "group": "",
        "modifiedTime": modified.isoformat().replace("+00:00", "Z"),
    }
    if kind == "symlink":
        info["isSymlink"] = True
        if entry.get("target"):
            info["symlinkTarget"] = entry["target"]
    return info


def _stat(sandbox: Sandbox, path: str) -> dict[str, Any] | None:
    try:
        return files.file_stat(sandbox=sandbox, path=path)
    except ApiError as exc:
        if exc.status_code == 404:
            return None
        raise


def stat(*, sandbox: Sandbox, path: Any) -> dict[str, Any]:
    target = path_of(path)
    entry = _stat(sandbox, target)
    if entry is None:
        raise ConnectError("not_found", f"path {target!r} does not exist")
    return {"entry": entry_info(entry)}


def list_dir(*, sandbox: Sandbox, path: Any, depth: Any) -> dict[str, Any]:
    """Entries of a directory, ``depth`` levels down (envd's 0 means 1)."""
    target = path_of(path)
    if isinstance(depth, bool) or not isinstance(depth, int | None) or (depth or 0) < 0:
        raise ConnectError("invalid_argument", "depth must be a positive number")
    levels = min(depth or 1, MAX_DEPTH)
    entry = _stat(sandbox, target)
    if entry is None:
        raise ConnectError("not_found", f"directory {target!r} does not exist")
    if entry.get("type") != "directory":
        raise ConnectError("invalid_argument", f"path {target!r} is not a directory")
    return {"entries": [entry_info(e) for e in _walk(sandbox, target, levels)]}


def _walk(sandbox: Sandbox, path: str, levels: int) -> Iterator[dict[str, Any]]:
    cursor: str | None = None
    while True:
        page = files.file_list(
            sandbox=sandbox, path=path, limit=files.LIST_LIMIT_MAX, cursor=cursor
        )
        for entry in page["entries"]:
            yield entry
            if levels > 1 and entry.get("type") == "directory":
                yield from _walk(sandbox, str(entry["path"]), levels - 1)
        cursor = page["next_cursor"]
        if not cursor:
            return


def _run(principal: Principal, sandbox: Sandbox, argv: list[str]) -> None:
    """Runs a file command as an operation; a non-zero exit is the command's error."""
    operation = operation_exec(
        principal=principal,
        sandbox=sandbox,
        request=ExecRequest(command=argv, timeout=60.0),
        operation_id=f"e2b-fs-{uuid.uuid4().hex}",
    )
    if operation.termination != "exited" or operation.exit_code != 0:
        stderr = operation.stderr or {}
        message = str(stderr.get("tail") or stderr.get("head") or operation.termination).strip()
        raise ConnectError("internal", f"{argv[0]} failed: {message}")


def make_dir(*, principal: Principal, sandbox: Sandbox, path: Any) -> dict[str, Any]:
    target = path_of(path)
    if _stat(sandbox, target) is not None:
        raise ConnectError("already_exists", f"path {target!r} already exists")
    _run(principal, sandbox, ["mkdir", "-p", "--", target])
    return stat(sandbox=sandbox, path=target)


def move(
    *, principal: Principal, sandbox: Sandbox, source: Any, destination: Any
) -> dict[str, Any]:
    src, dst = path_of(source, "source"), path_of(destination, "destination")
    if _stat(sandbox, src) is None:
        raise ConnectError("not_found", f"path {src!r} does not exist")
    _run(principal, sandbox, ["mv", "-T", "--", src, dst])
    return stat(sandbox=sandbox, path=dst)


def remove(*, principal: Principal, sandbox: Sandbox, path: Any) -> dict[str, Any]:
    target = path_of(path)
    if _stat(sandbox, target) is None:
        raise ConnectError("not_found", f"path {target!r} does not exist")
    _run(principal, sandbox, ["rm", "-rf", "--", target])
    return {}


# Directory watching: Hedgerow's watchers (apps/sandboxes/services/file_watch.py).
_EVENTS = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}
WATCH_POLL_S = 15.0  # one agent read while a WatchDir stream is quiet (then a keepalive)


def _watch_args(data: dict[str, Any]) -> tuple[str, bool, bool]:
    flags = []
    for name in ("recursive", "includeEntry"):
        value = data.get(name, False)
        if not isinstance(value, bool):
            raise ConnectError("invalid_argument", f"{name} must be true or false")
        flags.append(value)
    return path_of(data.get("path")), flags[0], flags[1]


def _fs_error(exc: ApiError) -> ConnectError:
    if exc.status_code == 404:
        return ConnectError("not_found", exc.message)
    if exc.status_code == 429:
        return ConnectError("resource_exhausted", exc.message)
    if exc.status_code == 400:
        return ConnectError("invalid_argument", exc.message)
    return ConnectError("internal", exc.message)


def event_of(event: dict[str, Any]) -> dict[str, Any]:
    """An agent watch event → envd's FilesystemEvent; its ``entry`` (a watcher with
    ``include_entry``, a name present after the change) → EntryInfo."""
    found = {"name": event["name"], "type": _EVENTS.get(event["type"], "EVENT_TYPE_UNSPECIFIED")}
    if event.get("entry"):
        found["entry"] = entry_info(event["entry"])
    return found


def watcher_create(*, sandbox: Sandbox, data: dict[str, Any]) -> dict[str, Any]:
    """CreateWatcher: ``{"watcherId"}``; GetWatcherEvents reads what changed since."""
    path, recursive, include_entry = _watch_args(data)
    try:
        created = file_watch.watcher_create(
            sandbox=sandbox, path=path, recursive=recursive, include_entry=include_entry
        )
    except ApiError as exc:
        raise _fs_error(exc) from exc
    return {"watcherId": created["watcher_id"]}


def watcher_events(*, sandbox: Sandbox, data: dict[str, Any]) -> dict[str, Any]:
    """GetWatcherEvents: what changed since the last call (envd answers at once)."""
    try:
        body = file_watch.watcher_events(
            sandbox=sandbox, watcher_id=str(data.get("watcherId") or ""), wait=0
        )
    except ApiError as exc:
        raise _fs_error(exc) from exc
    return {"events": [event_of(e) for e in body.get("events") or []]}


def watcher_remove(*, sandbox: Sandbox, data: dict[str, Any]) -> dict[str, Any]:
    try:
        file_watch.watcher_delete(sandbox=sandbox, watcher_id=str(data.get("watcherId") or ""))
    except ApiError as exc:
        raise _fs_error(exc) from exc
    return {}


def watch_dir_events(*, sandbox: Sandbox, data: dict[str, Any]) -> Iterator[bytes]:
    """WatchDir (the async SDK's stream): start once the watcher exists, then each
    change as the agent reports it, keepalives in silences; the watcher is removed when
    the stream ends (the client stops, or its timeout passes)."""
    path, recursive, include_entry = _watch_args(data)
    try:
        created = file_watch.watcher_create(
            sandbox=sandbox, path=path, recursive=recursive, include_entry=include_entry
        )
    except ApiError as exc:
        raise _fs_error(exc) from exc
    watcher_id = created["watcher_id"]
    try:
        yield envelope({"start": {}})
        while True:
            try:
                body = file_watch.watcher_events(
                    sandbox=sandbox, watcher_id=watcher_id, wait=WATCH_POLL_S
                )
            except ApiError as exc:
                raise _fs_error(exc) from exc
            events = body.get("events") or []
            for event in events:
                yield envelope({"filesystem": event_of(event)})
            if not events:
                yield envelope({"keepalive": {}})
    finally:
        with contextlib.suppress(ApiError):
            file_watch.watcher_delete(sandbox=sandbox, watcher_id=watcher_id)
