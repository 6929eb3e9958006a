from __future__ import annotations

import posixpath
from collections.abc import Iterator

from django.conf import settings
from django.http import HttpRequest, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.sandboxes import selectors
from apps.sandboxes.api.errors_schema import ERROR_RESPONSES
from apps.sandboxes.services import file_watch, files
from apps.tenancy.permissions import principal_of

PATH_PARAM = OpenApiParameter("path", str, required=True, description="absolute path")


def _body_chunks(raw: HttpRequest) -> Iterator[bytes]:
    while True:
        chunk = raw.read(files.CHUNK)
        if not chunk:
            return
        yield chunk


class FilesView(APIView):
    @extend_schema(
        parameters=[PATH_PARAM],
        responses={(200, "application/octet-stream"): bytes, **ERROR_RESPONSES},
        description="Downloads a file as raw bytes, streamed.",
    )
    def get(self, request: Request, sandbox_id: str) -> StreamingHttpResponse:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        path = request.query_params.get("path")
        # The agent answers before any header goes out: a missing, unreadable or
        # non-regular file is a typed 4xx, and Content-Length is the size of what the
        # agent opened (a symlink's target), never a separate stat's.
        download = files.file_open(sandbox=sandbox, path=path)
        response = StreamingHttpResponse(download.chunks(), content_type="application/octet-stream")
        response["Content-Length"] = str(download.size)
        response["Content-Disposition"] = (
            f'attachment; filename="{posixpath.basename(path or "") or "file"}"'
        )
        response._resource_closers.append(download.close)  # type: ignore[attr-defined]  # never streamed
        return response

    @extend_schema(
        parameters=[PATH_PARAM, OpenApiParameter("mode", str, description="octal, e.g. 0755")],
        request={"application/octet-stream": bytes},
        responses={200: dict, **ERROR_RESPONSES},
        description="Uploads raw bytes (streamed, atomic: temp file + rename; parents created).",
    )
    def put(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        length = request.headers.get("Content-Length")
        result = files.file_write(
            sandbox=sandbox,
            path=request.query_params.get("path"),
            chunks=_body_chunks(request._request),
            size=int(length) if length and length.isdigit() else None,
            max_bytes=int(settings.HEDGEROW_MAX_UPLOAD_BYTES),
            mode=request.query_params.get("mode"),
        )
        return Response(result)

    post = put

    @extend_schema(
        parameters=[
            PATH_PARAM,
            OpenApiParameter("recursive", bool, description="remove a whole tree"),
        ],
        responses={200: dict, **ERROR_RESPONSES},
        description="Removes a file, symlink or empty directory (`recursive=true`: a tree). "
        "404 when there is nothing at `path`.",
    )
    def delete(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        recursive = (request.query_params.get("recursive") or "").lower() in ("1", "true")
        return Response(
            files.file_delete(
                sandbox=sandbox, path=request.query_params.get("path"), recursive=recursive
            )
        )


class FileMkdirView(APIView):
    @extend_schema(
        parameters=[PATH_PARAM],
        request=None,
        responses={200: dict, **ERROR_RESPONSES},
        description="Creates a directory and its parents (idempotent); answers its entry. "
        "409 `busy` when a non-directory is there.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        return Response(files.file_mkdir(sandbox=sandbox, path=request.query_params.get("path")))


class FileRenameView(APIView):
    @extend_schema(
        parameters=[
            PATH_PARAM,
            OpenApiParameter("to", str, required=True, description="absolute new path"),
        ],
        request=None,
        responses={200: dict, **ERROR_RESPONSES},
        description="Renames (moves) `path` to `to` (parents created, a file there "
        "replaced); answers the entry at `to`.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        params = request.query_params
        return Response(
            files.file_rename(sandbox=sandbox, path=params.get("path"), to=params.get("to"))
        )


class TreeView(APIView):
    @extend_schema(
        parameters=[PATH_PARAM],
        responses={(200, "application/x-tar"): bytes, **ERROR_RESPONSES},
        description="Downloads a directory tree as one streamed tar (pax format): modes, "
        "symlinks and empty directories kept. `X-Tree-Bytes`: the total size of its "
        "regular files, for progress.",
    )
    def get(self, request: Request, sandbox_id: str) -> StreamingHttpResponse:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        download = files.tree_open(sandbox=sandbox, path=request.query_params.get("path"))
        response = StreamingHttpResponse(download.chunks(), content_type="application/x-tar")
        response["X-Tree-Bytes"] = str(download.tree_bytes)
        response._resource_closers.append(download.close)  # type: ignore[attr-defined]  # never streamed
        return response

    @extend_schema(
        parameters=[PATH_PARAM],
        request={"application/x-tar": bytes},
        responses={200: dict, **ERROR_RESPONSES},
        description="Uploads a tar (streamed) and extracts it into the directory `path` "
        "(created; files there are replaced, others kept). Members may not lead out of "
        "`path` (400 `archive_invalid`); modes are kept, setuid/setgid dropped.",
    )
    def put(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        length = request.headers.get("Content-Length")
        result = files.tree_write(
            sandbox=sandbox,
            path=request.query_params.get("path"),
            chunks=_body_chunks(request._request),
            size=int(length) if length and length.isdigit() else None,
            max_bytes=int(settings.HEDGEROW_MAX_UPLOAD_BYTES),
        )
        return Response(result)


class FileListView(APIView):
    @extend_schema(
        parameters=[
            PATH_PARAM,
            OpenApiParameter(
                "limit",
                int,
                description=f"entries per page (default {files.LIST_LIMIT_DEFAULT}, "
                f"max {files.LIST_LIMIT_MAX})",
            ),
            OpenApiParameter("cursor", str, description="next_cursor of the previous page"),
        ],
        responses={200: dict, **ERROR_RESPONSES},
        description="Lists a directory, sorted by name, one page at a time: `next_cursor` "
        "is null on the last page.",
    )
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        params = request.query_params
        return Response(
            files.file_list(
                sandbox=sandbox,
                path=params.get("path"),
                limit=params.get("limit"),
                cursor=params.get("cursor"),
            )
        )


class FileStatView(APIView):
    @extend_schema(parameters=[PATH_PARAM], responses={200: dict, **ERROR_RESPONSES})
    def get(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        return Response(files.file_stat(sandbox=sandbox, path=request.query_params.get("path")))


class FileWatchView(APIView):
    @extend_schema(
        parameters=[
            PATH_PARAM,
            OpenApiParameter("recursive", bool, description="watch the whole tree"),
            OpenApiParameter(
                "include_entry",
                bool,
                description="each event of a name that exists after the change carries "
                "its `entry` (as a stat answers it)",
            ),
        ],
        request=None,
        responses={200: dict, **ERROR_RESPONSES},
        description="Starts watching a directory: `{watcher_id, path, recursive, "
        "include_entry, entries}`. "
        "Read its events with GET …/files/watch/{watcher_id}?wait=S. At most 16 watchers "
        "per sandbox (429 `too_many_watchers`) and 10000 entries each (400 "
        "`too_many_entries`); docs/agent-protocol.md, Directory watchers.",
    )
    def post(self, request: Request, sandbox_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        recursive = request.query_params.get("recursive", "") in ("1", "true")
        include_entry = request.query_params.get("include_entry", "") in ("1", "true")
        return Response(
            file_watch.watcher_create(
                sandbox=sandbox,
                path=request.query_params.get("path"),
                recursive=recursive,
                include_entry=include_entry,
            )
        )


class FileWatcherView(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("wait", float, description="seconds to wait, ≤ 60")],
        responses={200: dict, **ERROR_RESPONSES},
        description="What changed under the watched directory since the last read "
        "(`events`: `{name, type}` with type create, remove, write, chmod or rename; "
        "names relative to it; `entry` too when the watcher has `include_entry`), "
        "waiting up to `wait` seconds for a change. 404 `watcher_not_found` for an "
        "unknown or expired watcher.",
    )
    def get(self, request: Request, sandbox_id: str, watcher_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        return Response(
            file_watch.watcher_events(
                sandbox=sandbox, watcher_id=watcher_id, wait=request.query_params.get("wait")
            )
        )

    @extend_schema(request=None, responses={200: dict, **ERROR_RESPONSES})
    def delete(self, request: Request, sandbox_id: str, watcher_id: str) -> Response:
        principal = principal_of(request)
        sandbox = selectors.sandbox_get(tenant=principal.tenant, sandbox_id=sandbox_id)
        return Response(file_watch.watcher_delete(sandbox=sandbox, watcher_id=watcher_id))
