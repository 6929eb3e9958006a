"""Unpacks one OCI layer (a tar stream) into a directory in overlayfs form.

Each layer is unpacked once, on its own, into an empty directory that later serves as a
read-only overlayfs lower dir. The OCI whiteouts become what overlayfs understands:
``.wh.<name>`` a character device 0/0 named ``<name>``, ``.wh..wh..opq`` the xattr
``trusted.overlay.opaque=y`` on its directory. Ownership is numeric as in the tar
(uid 0 stays 0: the sandbox's user namespace maps it at mount time), modes, xattrs,
hard links, symlinks and mtimes are kept.

Refused (``LayerRefused``): device nodes (a sandbox must not get a disk or /dev/mem
through its image), absolute or ``..`` paths, a path through a symlink of the layer,
a hard link to a path outside the layer, and ``trusted.overlay.*`` xattrs (the image
must not steer overlayfs: opaque, redirect, metacopy are ours to set).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .errors import DigestMismatch, LayerRefused

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"


class _HashingGunzip:
    """A file object over a gzip (or plain) tar stream that hashes what it yields.

    The sha256 of the uncompressed stream is the layer's diff id, which the image
    config lists: checking it proves the unpacked bytes are the ones the image means.
    """

    def __init__(self, raw: IO[bytes], gzipped: bool) -> None:
        self.raw = raw
        self.z = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
        self.buf = b""
        self.pos = 0  # consumed prefix of buf: slicing it off per read would copy ~1 MiB
        self.hash = hashlib.sha256()
        self.eof = False

    def _fill(self) -> None:
        chunk = self.raw.read(1 << 20)
        if not chunk:
            self.eof = True
            data = self.z.flush() if self.z is not None else b""
        else:
            data = self.z.decompress(chunk) if self.z is not None else chunk
        self.hash.update(data)
        self.buf = self.buf[self.pos :] + data
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        while not self.eof and (n < 0 or len(self.buf) - self.pos < n):
            self._fill()
        end = len(self.buf) if n < 0 else min(len(self.buf), self.pos + n)
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def drain(self) -> None:
        while not self.eof:
            self._fill()


def _clean(name: str, ref: str) -> str:
    """A member name relative to the layer root, or LayerRefused."""
    # a leading "/" is stripped, as tar writers and GNU tar do
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise LayerRefused(ref, f"path leaves the layer: {name!r}")
    return "/".join(parts)


def _check_parents(root: Path, rel: str, ref: str) -> None:
    """No parent of rel inside the layer may be a symlink (it could point anywhere)."""
    p = root
    for part in rel.split("/")[:-1]:
        p = p / part
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise LayerRefused(ref, f"path goes through a symlink: {rel!r}")


def _makedirs(root: Path, rel: str) -> None:
    parent = (root / rel).parent
    if not parent.exists():
        os.makedirs(parent, mode=0o755)


def _remove(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def unpack_layer(
    stream: IO[bytes], dest: Path, *, ref: str, gzipped: bool, diff_id: str | None
) -> int:
    """Unpack a layer into dest (an existing empty dir). Returns the unpacked bytes.

    diff_id (``sha256:…`` of the uncompressed tar), when given, is checked after the
    whole stream is read: a mismatch raises DigestMismatch (dest is the caller's to
    discard).
    """
    src = _HashingGunzip(stream, gzipped)
    size = 0
    dirs: list[tuple[Path, tarfile.TarInfo]] = []
    with tarfile.open(fileobj=src, mode="r|") as tar:  # type: ignore[call-overload]
        for m in _members(tar):
            rel = _clean(m.name, ref)
            if not rel:
                dirs.append((dest, m))  # the layer root's own mode and owner
                continue
            _check_parents(dest, rel, ref)
            base = os.path.basename(rel)
            path = dest / rel
            if base == OPAQUE:
                _makedirs(dest, rel)
                os.setxattr(path.parent, OPAQUE_XATTR, b"y")
                continue
            if base.startswith(WHITEOUT):
                if base.startswith(WHITEOUT + WHITEOUT):
                    continue  # other AUFS metadata (.wh..wh.plnk, …): not content
                target = path.parent / base[len(WHITEOUT) :]
                _makedirs(dest, rel)
                _remove(target)
                os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                continue
            if m.ischr() or m.isblk():
                raise LayerRefused(ref, f"device node in layer: {rel!r}")
            _makedirs(dest, rel)
            if m.isdir():
                if not (path.is_dir() and not path.is_symlink()):
                    _remove(path)
                    os.mkdir(path, 0o700)
                dirs.append((path, m))
                _xattrs(path, m, ref)
                continue
            _remove(path)
            if m.isreg():
                f = tar.extractfile(m)
                assert f is not None
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
                size += m.size
            elif m.issym():
                os.symlink(m.linkname, path)
            elif m.islnk():
                target_rel = _clean(m.linkname, ref)
                _check_parents(dest, target_rel, ref)
                target = dest / target_rel
                if not target_rel or not os.path.lexists(target) or _isdir(target):
                    raise LayerRefused(ref, f"hard link to a missing path: {rel!r}")
                os.link(target, path, follow_symlinks=False)
                continue  # the link shares the target's inode: owner/mode are its
            elif m.isfifo():
                os.mkfifo(path, 0o600)
            else:
                raise LayerRefused(ref, f"unsupported tar entry type {m.type!r}: {rel!r}")
            _owner_mode(path, m)
            _xattrs(path, m, ref)
            if not m.issym():
                os.utime(path, (m.mtime, m.mtime))
            else:
                os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)
        src.drain()  # trailing zero blocks count in the diff id
    # directories last: creating their entries changed their mtimes
    for path, m in reversed(dirs):
        _owner_mode(path, m)
        os.utime(path, (m.mtime, m.mtime))
    if diff_id is not None and "sha256:" + src.hash.hexdigest() != diff_id:
        raise DigestMismatch(
            ref, f"layer content is sha256:{src.hash.hexdigest()}, config says {diff_id}"
        )
    return size


def _isdir(path: Path) -> bool:
    return stat.S_ISDIR(os.lstat(path).st_mode)


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    yield from tar


def _owner_mode(path: Path, m: tarfile.TarInfo) -> None:
    os.lchown(path, m.uid, m.gid)
    if not m.issym():
        # after chown, which clears setuid/setgid
        os.chmod(path, stat.S_IMODE(m.mode))


def _xattrs(path: Path, m: tarfile.TarInfo, ref: str) -> None:
    for key, value in m.pax_headers.items():
        if not key.startswith("SCHILY.xattr."):
            continue
        name = key[len("SCHILY.xattr.") :]
        if name.startswith("trusted.overlay."):
            raise LayerRefused(ref, f"overlay xattr {name} in layer: {m.name!r}")
        raw = value.encode("utf-8", "surrogateescape")
        os.setxattr(path, name, raw, follow_symlinks=False)
