"""Whole directory trees as one streamed tar, both ways: modes, symlinks and empty
directories survive, and neither side holds the tree in memory. HTTP-agnostic, as
files.py: bytes go out through a write callable and come in through a read callable."""

from __future__ import annotations

import os
import stat
import tarfile
from typing import Any, Callable, Dict, List, Tuple

from .errors import ApiError
from .files import CHUNK, TooLarge, os_error

Writer = Callable[[bytes], None]
Reader = Callable[[int], bytes]

# Modes kept from an archive: permissions and the sticky bit. setuid/setgid bits from
# an uploaded tree are dropped (an upload must never mint a privileged binary).
KEPT_MODE_BITS = 0o1777


def tree_members(root: str) -> Tuple[List[Tuple[str, str]], int]:
    """(path, name in the archive) for the directory ``root`` and everything under it,
    symlinks not followed, devices/FIFOs/sockets left out; and the total bytes of the
    regular files (what a progress bar counts)."""
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise os_error(exc, root) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ApiError(400, "not_a_directory", f"{root} is not a directory", "path")
    members: List[Tuple[str, str]] = [(root, ".")]
    total = 0

    def failed(exc: OSError) -> None:
        raise os_error(exc, getattr(exc, "filename", None) or root) from None

    for dirpath, dirnames, filenames in os.walk(root, onerror=failed):
        dirnames.sort()
        relative_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # removed while we walked
            except OSError as exc:
                raise os_error(exc, path) from None
            if not (
                stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)
            ):
                continue
            arcname = name if relative_dir == "." else f"{relative_dir}/{name}"
            members.append((path, arcname))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return members, total


class _ChunkWriter:
    """A file object for tarfile's stream mode that hands on CHUNK-sized pieces."""

    def __init__(self, write: Writer) -> None:
        self._write = write
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        if len(self._buffer) >= CHUNK:
            self._write(bytes(self._buffer))
            self._buffer.clear()
        return len(data)

    def flush(self) -> None:
        if self._buffer:
            self._write(bytes(self._buffer))
            self._buffer.clear()


def write_tree(members: List[Tuple[str, str]], write: Writer) -> None:
    """Writes the members as a POSIX (pax) tar to ``write``. A file that vanished
    since the walk is skipped; one that cannot be read ends the stream with an error
    (the caller breaks the connection rather than end it as if complete)."""
    sink = _ChunkWriter(write)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for path, arcname in members:
            try:
                info = tar.gettarinfo(path, arcname=arcname)
            except FileNotFoundError:
                continue
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    sink.flush()


class _BodyFile:
    """A read-only file object over the request body, counting bytes against a cap."""

    def __init__(self, read: Reader, max_bytes: int) -> None:
        self._read = read
        self.max_bytes = max_bytes
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._read(CHUNK if n is None or n < 0 else n)
        self.size += len(data)
        if self.size > self.max_bytes:
            raise TooLarge(self.max_bytes)
        return data


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _refuse(name: str, why: str) -> ApiError:
    return ApiError(400, "archive_invalid", f"archive member {name[:200]!r}: {why}", "body")


def extract_tree(dest: str, read: Reader, max_bytes: int) -> Dict[str, Any]:
    """Extracts a tar stream into the directory ``dest`` (created, parents too; files
    already there are replaced, others kept). Members must stay inside ``dest``: no
    absolute names, no ``..``, no hard link out, and nothing written through a symlink
    that leads out. Modes are kept (setuid/setgid dropped), owners are the agent's."""
    try:
        os.makedirs(dest, exist_ok=True)
    except FileExistsError:
        raise ApiError(400, "not_a_directory", f"{dest} is not a directory", "path") from None
    except OSError as exc:
        raise os_error(exc, dest) from None
    root = os.path.realpath(dest)
    body = _BodyFile(read, max_bytes)
    files = directories = links = 0
    # Directory modes are set last, deepest first: a read-only directory (0555) must
    # still take the files the archive puts in it.
    directory_modes: List[Tuple[str, int]] = []
    try:
        with tarfile.open(fileobj=body, mode="r|*") as tar:  # type: ignore[call-overload]
            for member in tar:
                name = os.path.normpath(member.name)
                if member.name.startswith("/") or name == ".." or name.startswith("../"):
                    raise _refuse(member.name, "names a path outside the target")
                if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
                    raise _refuse(member.name, "only files, directories and links are accepted")
                target = os.path.join(root, name) if name != "." else root
                parent = os.path.realpath(os.path.dirname(target)) if name != "." else root
                if not _inside(root, parent):
                    raise _refuse(member.name, "would be written through a link leading out")
                if member.islnk():
                    linked = os.path.realpath(os.path.join(root, os.path.normpath(member.linkname)))
                    if not _inside(root, linked):
                        raise _refuse(member.name, "hard link to a path outside the target")
                    member.linkname = os.path.relpath(linked, root)
                member.name = name
                member.mode &= KEPT_MODE_BITS
                member.uid, member.gid = os.geteuid(), os.getegid()
                member.uname = member.gname = ""
                if member.isdir():
                    directories += 1
                    directory_modes.append((target, member.mode))
                    os.makedirs(target, exist_ok=True)
                    # Writable until the end (a read-only one from an earlier upload
                    # must take this one's files); its mode is set last.
                    os.chmod(target, stat.S_IMODE(os.stat(target).st_mode) | 0o700)
                    continue
                elif member.issym():
                    links += 1
                else:
                    files += 1
                if (member.isreg() or member.issym()) and os.path.lexists(target):
                    if os.path.isdir(target) and not os.path.islink(target):
                        raise ApiError(
                            409, "busy", f"{target} is a directory in the way of a file", "path"
                        )
                    os.unlink(target)
                extra: Dict[str, Any] = {}
                if hasattr(tarfile, "fully_trusted_filter"):
                    extra["filter"] = "fully_trusted"  # checked above, as our own rules
                tar.extract(member, root, set_attrs=True, numeric_owner=True, **extra)
        for path, mode in sorted(directory_modes, reverse=True):
            os.chmod(path, mode)
    except tarfile.TarError as exc:
        raise ApiError(400, "archive_invalid", f"not a tar archive: {exc}", "body") from None
    except OSError as exc:
        raise os_error(exc, str(exc.filename or dest)) from None
    return {
        "path": dest,
        "files": files,
        "directories": directories,
        "symlinks": links,
        "bytes": body.size,
    }
