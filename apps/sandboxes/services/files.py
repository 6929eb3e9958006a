"""File I/O through the agent, streamed both ways (no whole-file buffering)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from asgiref.sync import sync_to_async

from apps.billing.limits import transfer_admit, transfer_release, upload_admit, upload_record
from apps.core.errors import ApiError
from apps.core.inputs import check_text
from apps.sandboxes.agent_client import AgentError, AgentUnreachable
from apps.sandboxes.models import Sandbox
from apps.sandboxes.services.operations import AgentUnavailable, agent_for, ensure_ready

CHUNK = 256 * 1024


# As the agent's own limits (podagent/files.py): Linux's PATH_MAX and NAME_MAX, and a
# depth past any real tree. Checked here too, so a bad path never reaches the agent.
MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255
MAX_DEPTH = 256
# File listings are paged (docs/agent-protocol.md, docs/orchard.md).
LIST_LIMIT_DEFAULT = 1000
LIST_LIMIT_MAX = 10000


def _check_path(path: str | None) -> str:
    if not path:
        raise ApiError("path is required", field="path", code="path_required")
    check_text(path, "path", nul=True)
    if not path.startswith("/"):
        raise ApiError("path must be absolute", field="path", code="path_not_absolute")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise ApiError(f"path is over {MAX_PATH_BYTES} bytes", field="path", code="path_too_long")
    parts = [part for part in path.split("/") if part]
    if len(parts) > MAX_DEPTH:
        raise ApiError(f"path is over {MAX_DEPTH} levels deep", field="path", code="path_too_deep")
    if any(len(part.encode()) > MAX_NAME_BYTES for part in parts):
        raise ApiError(
            f"a path component is over {MAX_NAME_BYTES} bytes", field="path", code="name_too_long"
        )
    return path


def list_limit(raw: Any) -> int:
    """A listing's page size: the default when absent, else 1 … LIST_LIMIT_MAX."""
    if raw is None or raw == "":
        return LIST_LIMIT_DEFAULT
    try:
        limit = int(raw)
    except (TypeError, ValueError):
        raise ApiError("limit must be an integer", field="limit", code="validation_error") from None
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise ApiError(
            f"limit must be 1 to {LIST_LIMIT_MAX}", field="limit", code="validation_error"
        )
    return limit


@contextmanager
def _transfer(sandbox: Sandbox, nbytes: int) -> Iterator[None]:
    """An upload's slot in the per-kind pools (sandbox, tenant, installation) for as
    long as its bytes flow: 429 naming the limit before any byte reaches the agent."""
    tenant_id, key = str(sandbox.tenant_id), str(sandbox.external_id)
    lease = transfer_admit(tenant_id=tenant_id, sandbox_key=key, nbytes=nbytes)
    try:
        yield
    finally:
        transfer_release(tenant_id=tenant_id, sandbox_key=key, lease=lease)


def translate(exc: AgentError) -> ApiError:
    """The agent's typed error as the API's (its status, code and field)."""
    return ApiError(exc.message, code=exc.code, field=exc.field or "path", status_code=exc.status)


def upload_params(
    *, sandbox: Sandbox, path: str | None, size: int | None, max_bytes: int, mode: str | None
) -> dict[str, Any]:
    """Everything an upload is checked against before a byte of its body is read: the
    sandbox ready, the path, the team's per-upload maximum and bytes per day (413 /
    429). The agent's query parameters (it enforces ``max_bytes`` on the bytes too).
    Both upload paths use it: ``file_write`` and the upload fast path
    (apps/sandboxes/api/files_fastpath.py)."""
    ensure_ready(sandbox)
    target = _check_path(path)
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
    return params


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
    params = upload_params(sandbox=sandbox, path=path, size=size, max_bytes=max_bytes, mode=mode)
    headers = {"Content-Length": str(size)} if size is not None else None
    # The per-kind pools (sandbox, tenant, installation): 429 naming the limit.
    with _transfer(sandbox, size or 0):
        try:
            response = agent_for(sandbox).request(
                "PUT", "/files", params=params, content=chunks, headers=headers, timeout=600
            )
        except AgentError as exc:
            raise translate(exc) from exc
        except AgentUnreachable as exc:
            raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    if size is None:  # a streamed upload of unknown length counts once its size is known
        upload_record(tenant_id=str(sandbox.tenant_id), nbytes=int(result.get("size") or 0))
    return result


def _agent_json(
    sandbox: Sandbox, path: str, endpoint: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    ensure_ready(sandbox)
    params = {"path": _check_path(path), **(extra or {})}
    try:
        response = agent_for(sandbox).request("GET", endpoint, params=params)
    except AgentError as exc:
        raise translate(exc) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    return result


def file_list(
    *, sandbox: Sandbox, path: str | None, limit: Any = None, cursor: str | None = None
) -> dict[str, Any]:
    """One page of a directory's entries, sorted by name: at most ``limit`` (default
    LIST_LIMIT_DEFAULT, max LIST_LIMIT_MAX) after ``cursor``. ``next_cursor`` is the
    cursor of the next page, null on the last one."""
    params: dict[str, Any] = {"limit": list_limit(limit)}
    if cursor:
        check_text(cursor, "cursor", nul=True)
        params["after"] = cursor
    listing = _agent_json(sandbox, path or "/workspace", "/files/list", params)
    return {
        "path": listing.get("path"),
        "entries": listing.get("entries", []),
        "next_cursor": listing.get("next"),
    }


def _agent_post(
    sandbox: Sandbox, method: str, endpoint: str, params: dict[str, Any]
) -> dict[str, Any]:
    ensure_ready(sandbox)
    try:
        response = agent_for(sandbox).request(method, endpoint, params=params)
    except AgentError as exc:
        raise translate(exc) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    return result


def file_delete(*, sandbox: Sandbox, path: str | None, recursive: bool) -> dict[str, Any]:
    """Removes a file, link or empty directory (``recursive``: a whole tree). A missing
    path is a 404, a non-empty directory without ``recursive`` a 400."""
    params = {"path": _check_path(path), "recursive": "1" if recursive else "0"}
    return _agent_post(sandbox, "DELETE", "/files", params)


def file_mkdir(*, sandbox: Sandbox, path: str | None) -> dict[str, Any]:
    """Creates a directory and its parents (idempotent); answers its entry."""
    return _agent_post(sandbox, "POST", "/files/mkdir", {"path": _check_path(path)})


def file_rename(*, sandbox: Sandbox, path: str | None, to: str | None) -> dict[str, Any]:
    """Renames ``path`` to ``to`` inside the sandbox (parents created; a file there is
    replaced); answers the entry at ``to``."""
    source = _check_path(path)
    try:
        target = _check_path(to)
    except ApiError as exc:
        raise ApiError(exc.message.replace("path", "to"), code=exc.code, field="to") from exc
    return _agent_post(sandbox, "POST", "/files/rename", {"path": source, "to": target})


def file_stat(*, sandbox: Sandbox, path: str | None) -> dict[str, Any]:
    return _agent_json(sandbox, _check_path(path), "/files/stat")


class Download:
    """An opened download: the agent has already answered (so any error was typed
    before a header went out), ``size`` is what it opened, and ``chunks()`` yields
    exactly that many bytes. Close it (``chunks()`` does when it ends)."""

    def __init__(self, response: httpx.Response, context: Any) -> None:
        self._response, self._context = response, context
        self.size = int(response.headers["Content-Length"])
        self._closed = False
        self._release: Callable[[], None] | None = None

    def admit(self, sandbox: Sandbox, nbytes: int) -> None:
        """Takes the transfer's slot in the per-kind pools (429 naming the limit, the
        download closed); ``close`` gives it back."""
        tenant_id, key = str(sandbox.tenant_id), str(sandbox.external_id)
        try:
            lease = transfer_admit(tenant_id=tenant_id, sandbox_key=key, nbytes=nbytes)
        except ApiError:
            self.close()
            raise
        self._release = lambda: transfer_release(tenant_id=tenant_id, sandbox_key=key, lease=lease)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._context.__exit__(None, None, None)
            finally:
                if self._release is not None:
                    self._release()

    def read_all(self, limit: int) -> bytes:
        try:
            if self.size > limit:
                raise ApiError(
                    f"the file is larger than {limit} bytes", code="too_large", status_code=413
                )
            return b"".join(self._response.iter_raw(CHUNK))
        except httpx.TransportError as exc:
            raise AgentUnavailable(f"the download broke off: {exc}") from exc
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        # The pooled sync client, one chunk per thread hop: a sync iterator would be
        # read whole into memory by Django's ASGI handler. A body shorter than
        # Content-Length (the file shrank) raises here, so the connection is dropped
        # rather than ending short as if complete.
        raw = self._response.iter_raw(CHUNK)
        step = sync_to_async(lambda: next(raw, None), thread_sensitive=False)
        try:
            while (chunk := await step()) is not None:
                yield chunk
        finally:
            await sync_to_async(self.close, thread_sensitive=False)()


def download_target(*, sandbox: Sandbox, path: str | None) -> str:
    """What a download is checked against before the agent is asked: the sandbox
    ready, the path. Both download paths use it (``file_open`` and the fast path,
    apps/sandboxes/api/files_fastpath.py)."""
    ensure_ready(sandbox)
    return _check_path(path)


def file_open(*, sandbox: Sandbox, path: str | None) -> Download:
    """Opens ``path`` for download, a symlink followed inside the sandbox. A missing,
    unreadable, non-regular file or directory is a typed ApiError (404/403/400)."""
    target = download_target(sandbox=sandbox, path=path)
    try:
        response, context = agent_for(sandbox).stream_download(target)
    except AgentError as exc:
        raise translate(exc) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    download = Download(response, context)
    download.admit(sandbox, download.size)
    return download


class TreeDownload(Download):
    """A directory as one streamed tar (the agent's ``/files/archive``): its length is
    not known ahead, ``tree_bytes`` is the total of the tree's regular files."""

    def __init__(self, response: httpx.Response, context: Any) -> None:
        self._response, self._context = response, context
        self.size = -1
        self.tree_bytes = int(response.headers.get("X-Tree-Bytes") or 0)
        self._closed = False
        self._release = None


def tree_open(*, sandbox: Sandbox, path: str | None) -> TreeDownload:
    """Opens the directory ``path`` for download as a tar that keeps modes, symlinks
    and empty directories. A missing path or one that is not a directory is a typed
    ApiError (404/400) before any header goes out."""
    ensure_ready(sandbox)
    target = _check_path(path)
    try:
        response, context = agent_for(sandbox).stream_download(target, "/files/archive")
    except AgentError as exc:
        raise translate(exc) from exc
    except AgentUnreachable as exc:
        raise AgentUnavailable(str(exc)) from exc
    download = TreeDownload(response, context)
    download.admit(sandbox, download.tree_bytes)
    return download


def tree_write(
    *,
    sandbox: Sandbox,
    path: str | None,
    chunks: Iterator[bytes],
    size: int | None,
    max_bytes: int,
) -> dict[str, Any]:
    """Streams a tar into the directory ``path`` (created; files there are replaced,
    others kept). Counted against the upload quotas as one upload of the archive's
    size; a bad archive is a 400 ``archive_invalid``, a member leading out of ``path``
    too (what was extracted before it stays)."""
    ensure_ready(sandbox)
    target = _check_path(path)
    max_bytes = upload_admit(tenant_id=str(sandbox.tenant_id), size=size, max_bytes=max_bytes)
    if size is not None and size > max_bytes:
        raise ApiError(
            f"upload of {size} bytes exceeds the limit of {max_bytes}",
            code="too_large",
            status_code=413,
            extra={"limit": "max_upload_bytes", "value": max_bytes, "current": size},
        )
    headers = {"Content-Length": str(size)} if size is not None else None
    with _transfer(sandbox, size or 0):
        try:
            response = agent_for(sandbox).request(
                "PUT",
                "/files/archive",
                params={"path": target, "max_bytes": max_bytes},
                content=chunks,
                headers=headers,
                timeout=600,
            )
        except AgentError as exc:
            raise translate(exc) from exc
        except AgentUnreachable as exc:
            raise AgentUnavailable(str(exc)) from exc
    result: dict[str, Any] = response.json()
    if size is None:
        upload_record(tenant_id=str(sandbox.tenant_id), nbytes=int(result.get("bytes") or 0))
    return result
