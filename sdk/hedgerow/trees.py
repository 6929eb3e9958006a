"""Directory trees as one streamed tar, both ways (``/files/archive``): modes,
symlinks and empty directories arrive as they were, in one request instead of one per
file, and neither side holds the tree in memory."""

from __future__ import annotations

import io
import os
import queue
import stat
import tarfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from hedgerow._common import CHUNK
from hedgerow.errors import HedgerowError

Progress = Optional[Callable[[int], None]]
BLOCK = 512
# Permissions and the sticky bit; setuid/setgid are never recreated from an archive.
KEPT_MODE_BITS = 0o1777


def local_members(root: Path) -> Tuple[List[Tuple[Path, str]], int]:
    """(path, name in the archive) for ``root`` and everything under it (symlinks not
    followed; devices, FIFOs and sockets left out) and the total bytes of its files."""
    members: List[Tuple[Path, str]] = [(root, ".")]
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        relative_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:
                continue
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                continue
            members.append((path, name if relative_dir == "." else f"{relative_dir}/{name}"))
            if stat.S_ISREG(mode):
                total += path.lstat().st_size
    return members, total


def tar_chunks(members: List[Tuple[Path, str]], progress: Progress = None) -> Iterator[bytes]:
    """A pax tar of the members, produced piece by piece (a header, then the file in
    CHUNK-sized reads): constant memory for any tree. ``progress(n)`` gets the bytes
    of file content as they are read."""
    # A TarFile only for gettarinfo (stat → header); what it would write is discarded.
    encoder = tarfile.open(fileobj=io.BytesIO(), mode="w|")  # noqa: SIM115 - never closed: closing writes
    for path, arcname in members:
        try:
            info = encoder.gettarinfo(str(path), arcname=arcname)
        except FileNotFoundError:
            continue
        if info.islnk():  # a second name of a hard-linked file: sent as a file again
            info.type, info.linkname, info.size = tarfile.REGTYPE, "", path.stat().st_size
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if not info.isreg():
            continue
        left = info.size
        with open(path, "rb") as handle:
            while left > 0:
                chunk = handle.read(min(CHUNK, left))
                if not chunk:
                    raise HedgerowError(
                        f"{path} shrank while it was being uploaded; upload it again",
                        code="local_file_changed",
                    )
                left -= len(chunk)
                if progress is not None:
                    progress(len(chunk))
                yield chunk
        padding = -info.size % BLOCK
        if padding:
            yield b"\0" * padding
    yield b"\0" * (2 * BLOCK)


class ChunkReader:
    """A read-only file object over an iterator of byte chunks (tarfile's stream mode
    reads from it)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buffer) < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buffer += chunk
        if n < 0:
            data, self._buffer = self._buffer, b""
        else:
            data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data


class QueueChunks:
    """Chunks handed over from an event loop to a thread that extracts them; ``None``
    ends the stream, an exception is raised in the reader."""

    def __init__(self) -> None:
        self.queue: "queue.Queue[Any]" = queue.Queue(maxsize=16)
        self.closed = False  # the reader is gone: a put must not wait for it

    def put(self, item: Any) -> None:
        while not self.closed:
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def extract(self, dest: Path, progress: Progress = None) -> Dict[str, int]:
        """``extract`` from these chunks (run it in a thread)."""
        try:
            return extract(dest, ChunkReader(iter(self)), progress)
        finally:
            self.closed = True

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _refuse(name: str, why: str) -> HedgerowError:
    return HedgerowError(f"archive member {name[:200]!r}: {why}", code="archive_invalid")


def extract(dest: Path, source: Any, progress: Progress = None) -> Dict[str, int]:
    """Extracts a tar stream (``source.read``) into the directory ``dest`` (created;
    files already there are replaced). Nothing may land outside ``dest``. Modes are
    kept (setuid/setgid dropped); directory modes are set last, so a read-only
    directory still receives its files. ``progress(n)`` gets file bytes as written."""
    dest.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(dest)
    counts = {"files": 0, "directories": 0, "symlinks": 0, "bytes": 0}
    directory_modes: List[Tuple[str, int]] = []
    with tarfile.open(fileobj=source, mode="r|") as tar:
        for member in tar:
            name = os.path.normpath(member.name)
            if member.name.startswith("/") or name == ".." or name.startswith("../"):
                raise _refuse(member.name, "names a path outside the target")
            target = os.path.join(root, name) if name != "." else root
            parent = os.path.realpath(os.path.dirname(target)) if name != "." else root
            if not _inside(root, parent):
                raise _refuse(member.name, "would be written through a link leading out")
            mode = member.mode & KEPT_MODE_BITS
            if member.isdir():
                os.makedirs(target, exist_ok=True)
                # Writable until the end: its mode is set last.
                os.chmod(target, stat.S_IMODE(os.stat(target).st_mode) | 0o700)
                directory_modes.append((target, mode))
                counts["directories"] += 1
                continue
            if os.path.lexists(target) and not (
                os.path.isdir(target) and not os.path.islink(target)
            ):
                os.unlink(target)
            if member.issym():
                os.symlink(member.linkname, target)
                counts["symlinks"] += 1
            elif member.islnk():
                linked = os.path.realpath(os.path.join(root, os.path.normpath(member.linkname)))
                if not _inside(root, linked):
                    raise _refuse(member.name, "hard link to a path outside the target")
                os.link(linked, target)
                counts["files"] += 1
            elif member.isreg():
                data = tar.extractfile(member)
                assert data is not None
                with open(target, "wb") as handle:
                    while True:
                        chunk = data.read(CHUNK)
                        if not chunk:
                            break
                        handle.write(chunk)
                        counts["bytes"] += len(chunk)
                        if progress is not None:
                            progress(len(chunk))
                os.chmod(target, mode)
                counts["files"] += 1
            else:
                raise _refuse(member.name, "only files, directories and symlinks are accepted")
    for path, mode in sorted(directory_modes, reverse=True):
        os.chmod(path, mode)
    return counts
