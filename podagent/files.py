"""File operations. HTTP-agnostic: bodies come in through a read callable and
never sit in memory whole; every OSError maps to a typed ApiError."""

from __future__ import annotations

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


def check_path(path: Optional[str]) -> str:
    if not path or "\0" in path:
        raise ApiError(400, "bad_request", "path query parameter is required", "path")
    if not os.path.isabs(path):
        raise ApiError(400, "path_not_absolute", f"{path} is not absolute", "path")
    return os.path.normpath(path) if path != "/" else path


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


def list_dir(path: str) -> Dict[str, Any]:
    entries = []
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for e in it)
    except OSError as exc:
        raise os_error(exc, path) from None
    for name in names:
        try:
            entries.append(entry(os.path.join(path, name), name))
        except FileNotFoundError:
            continue  # removed while we listed
        except OSError as exc:
            raise os_error(exc, path) from None
    return {"path": path, "entries": entries}


def open_for_read(path: str) -> "tuple[Any, int]":
    try:
        fh = open(path, "rb")  # noqa: SIM115 - the caller closes it after streaming
    except OSError as exc:
        raise os_error(exc, path) from None
    st = os.fstat(fh.fileno())
    if stat.S_ISDIR(st.st_mode):
        fh.close()
        raise ApiError(400, "is_a_directory", f"{path} is a directory", "path")
    return fh, st.st_size


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
