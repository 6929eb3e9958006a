"""File operations. HTTP-agnostic: bodies come in through a read callable and
never sit in memory whole; every OSError maps to a typed ApiError."""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from typing import Any, Callable, Dict, Optional

from .errors import ApiError

DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
CHUNK = 256 * 1024

Reader = Callable[[int], bytes]


class TooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, "too_large", f"body exceeds {limit} bytes")


# Linux's PATH_MAX (4096 with the NUL) and NAME_MAX; a depth far past any real tree
# (os.makedirs recurses once per missing level).
MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255
MAX_DEPTH = 256
LIST_LIMIT_MAX = 10000


def check_path(path: Optional[str]) -> str:
    if not path:
        raise ApiError(400, "bad_request", "path query parameter is required", "path")
    if "\0" in path:
        raise ApiError(400, "invalid_text", "path contains a NUL byte", "path")
    if not os.path.isabs(path):
        raise ApiError(400, "path_not_absolute", f"{path[:200]} is not absolute", "path")
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_PATH_BYTES:
        raise ApiError(400, "path_too_long", f"path is over {MAX_PATH_BYTES} bytes", "path")
    parts = [part for part in path.split("/") if part]
    if len(parts) > MAX_DEPTH:
        raise ApiError(400, "path_too_deep", f"path is over {MAX_DEPTH} levels deep", "path")
    if any(len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES for part in parts):
        raise ApiError(
            400, "name_too_long", f"a path component is over {MAX_NAME_BYTES} bytes", "path"
        )
    return os.path.normpath(path) if path != "/" else path


def not_regular(path: str) -> ApiError:
    return ApiError(
        400,
        "not_a_regular_file",
        f"{path} is not a regular file (a device, FIFO or socket)",
        "path",
    )


def os_error(exc: OSError, path: str) -> ApiError:
    code = exc.errno
    if code == errno.ENOENT:
        return ApiError(404, "not_found", f"{path} does not exist", "path")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ApiError(403, "permission_denied", f"{path}: {exc.strerror}", "path")
    if code == errno.EISDIR:
        return ApiError(400, "is_a_directory", f"{path} is a directory", "path")
    if code == errno.ENOTDIR:
        return ApiError(400, "not_a_directory", f"{path}: a parent is not a directory", "path")
    if code == errno.ENOTEMPTY:
        return ApiError(400, "directory_not_empty", f"{path} is not empty", "path")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ApiError(507, "no_space", f"{path}: {exc.strerror}", "path")
    if code == errno.ENAMETOOLONG:
        return ApiError(400, "path_too_long", f"{path[:200]}…: {exc.strerror}", "path")
    if code == errno.ELOOP:
        return ApiError(400, "symlink_loop", f"{path}: {exc.strerror}", "path")
    if code in (errno.EBUSY, errno.ETXTBSY, errno.EEXIST):
        return ApiError(409, "busy", f"{path}: {exc.strerror}", "path")
    if code in (errno.EINVAL, errno.EXDEV, errno.ENXIO, errno.ENODEV):
        return ApiError(400, "unsupported_path", f"{path}: {exc.strerror}", "path")
    return ApiError(500, "io_error", f"{path}: {exc.strerror or exc}", "path")


def parse_mode(raw: Optional[str]) -> Optional[int]:
    if raw is None or raw == "":
        return None
    try:
        mode = int(raw, 8)
    except ValueError:
        raise ApiError(400, "bad_request", "mode must be octal, e.g. 0644", "mode") from None
    if not 0 <= mode <= 0o7777:
        raise ApiError(400, "bad_request", "mode out of range", "mode")
    return mode


def write_file(path: str, read: Reader, mode: Optional[int], max_bytes: int) -> Dict[str, Any]:
    """Stream the body into a temp file beside `path`, then rename it into place,
    so readers never see a partial file and a failed upload leaves nothing."""
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise ApiError(400, "is_a_directory", f"{path} is a directory", "path")
    try:
        existing: Optional[os.stat_result] = os.lstat(path)
    except OSError:
        existing = None
    if existing is not None and not (
        stat.S_ISREG(existing.st_mode) or stat.S_ISLNK(existing.st_mode)
    ):
        # Replacing /dev/null or a FIFO with a file is never what an upload means.
        raise not_regular(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:
        raise ApiError(400, "not_a_directory", f"{parent} is not a directory", "path") from None
    except OSError as exc:
        raise os_error(exc, path) from None
    if mode is None:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".hedgerow-upload-")
    except OSError as exc:
        raise os_error(exc, path) from None
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as fh:
            while True:
                chunk = read(CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise TooLarge(max_bytes)
                digest.update(chunk)
                fh.write(chunk)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise os_error(exc, path) from None
        raise
    return {"path": path, "size": size, "sha256": digest.hexdigest()}


def entry(path: str, name: Optional[str] = None) -> Dict[str, Any]:
    st = os.lstat(path)
    target: Optional[str] = None
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
        try:
            target = os.readlink(path)
        except OSError:
            target = None
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISDIR(st.st_mode):
        kind = "directory"
    else:
        kind = "other"
    return {
        "name": name if name is not None else os.path.basename(path) or path,
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": "%04o" % stat.S_IMODE(st.st_mode),
        "modified": st.st_mtime,
        "target": target,
    }


def stat_path(path: str) -> Dict[str, Any]:
    try:
        return entry(path)
    except OSError as exc:
        raise os_error(exc, path) from None


def list_dir(path: str, limit: Optional[int] = None, after: Optional[str] = None) -> Dict[str, Any]:
    """Entries sorted by name; with ``limit``, at most that many after the name
    ``after`` (exclusive), and ``next``: the name to pass as ``after`` for the next
    page (null on the last one). Only the page's entries are stat'ed."""
    entries = []
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for e in it)
    except OSError as exc:
        raise os_error(exc, path) from None
    start = bisect.bisect_right(names, after) if after else 0
    end = len(names) if limit is None else min(len(names), start + limit)
    following = names[end - 1] if end < len(names) and end > start else None
    for name in names[start:end]:
        try:
            entries.append(entry(os.path.join(path, name), name))
        except FileNotFoundError:
            continue  # removed while we listed
        except OSError as exc:
            raise os_error(exc, path) from None
    return {"path": path, "entries": entries, "next": following}


def parse_limit(raw: Optional[str]) -> Optional[int]:
    if raw is None or raw == "":
        return None
    try:
        limit = int(raw)
    except ValueError:
        raise ApiError(400, "bad_request", "limit must be an integer", "limit") from None
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise ApiError(400, "bad_request", f"limit must be 1 to {LIST_LIMIT_MAX}", "limit")
    return limit


def open_for_read(path: str) -> "tuple[Any, int]":
    """Opens what ``path`` names, a symlink followed (inside the sandbox), and answers
    with the size of what was opened: the caller sends exactly that many bytes, so the
    Content-Length always describes the body. Only regular files: O_NONBLOCK so a
    FIFO cannot hang the open; a device or FIFO is refused (its size means nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise os_error(exc, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ApiError(400, "is_a_directory", f"{path} is a directory", "path")
        raise not_regular(path)
    return os.fdopen(fd, "rb"), st.st_size


def delete_path(path: str, recursive: bool) -> Dict[str, Any]:
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            if recursive:
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise os_error(exc, path) from None
    return {"path": path, "deleted": True}


def make_dir(path: str) -> Dict[str, Any]:
    """Creates the directory and its parents; an existing directory is success (the
    answer is its entry either way), an existing non-directory 409 ``busy``."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise ApiError(409, "busy", f"{path} exists and is not a directory", "path") from None
    except OSError as exc:
        raise os_error(exc, path) from None
    return stat_path(path)


def rename_path(source: str, destination: str) -> Dict[str, Any]:
    """Renames (moves) ``source`` to ``destination`` (parents created), replacing a
    file there; a directory onto a non-empty directory is 400 ``directory_not_empty``."""
    try:
        os.lstat(source)
    except OSError as exc:
        raise os_error(exc, source) from None
    try:
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.rename(source, destination)
    except OSError as exc:
        raise os_error(exc, destination) from None
    return stat_path(destination)
