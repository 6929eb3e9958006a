"""Snapshots of a sandbox's filesystem state on the local backend (docs/snapshots.md).

A sandbox's writable state is one btrfs subvolume, ``<storage>/<sid>``: the overlay
root's upper dir (``root/upper``), ``workspace/`` and ``tmp/``. A snapshot is a
read-only btrfs snapshot of that subvolume, ``<storage>/.snapshots/<snapshot id>``,
plus ``<snapshot id>.json`` (written last: a snapshot exists only once its manifest
does). A restore is a writable snapshot of the snapshot as the new sandbox's subvolume:
both are one ioctl whatever the size, and the data is shared until a side writes.

Files carry host ids ``BASE+n`` of the sandbox that wrote them, and every sandbox has
its own ``BASE``: a restore shifts the owners to the new sandbox's range (metadata
only, so the data extents stay shared). Fingerprints record owners relative to
``BASE``, so a faithful restore has the snapshot's fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from podagent.userns import RANGE as USERNS_RANGE

# what a snapshot holds, relative to the sandbox's subvolume; the overlay's work dir
# (root/work) is the kernel's scratch space and is made fresh on restore
CAPTURED = ("root/upper", "workspace", "tmp")
SNAPSHOTS_DIR = ".snapshots"
_CHUNK = 1 << 20


def _owner(uid: int, base: int) -> str:
    rel = uid - base
    return str(rel) if 0 <= rel < USERNS_RANGE else f"host:{uid}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME)
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def _entry(path: Path, st: os.stat_result, base: int, known: str | None = None) -> str:
    """``type mode uid gid size content``: content is the sha256 of a regular file,
    the target of a symlink, the device numbers of a device (overlay whiteouts are
    0/0 character devices). ``known``: the entry the content is known to be (a
    restore from an unchanged snapshot), whose hash is taken if the rest agrees."""
    mode = stat.S_IMODE(st.st_mode)
    owner = f"{_owner(st.st_uid, base)}:{_owner(st.st_gid, base)}"
    if stat.S_ISREG(st.st_mode):
        head = f"f {mode:o} {owner} {st.st_size} "
        if known is not None and known.startswith(head):
            return known
        return head + _sha256(path)
    if stat.S_ISDIR(st.st_mode):
        return f"d {mode:o} {owner}"
    if stat.S_ISLNK(st.st_mode):
        return f"l {mode:o} {owner} {os.readlink(path)}"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return f"{kind} {mode:o} {owner} {os.major(st.st_rdev)},{os.minor(st.st_rdev)}"
    if stat.S_ISFIFO(st.st_mode):
        return f"p {mode:o} {owner}"
    return f"s {mode:o} {owner}"  # a socket: its inode is state, its peer is not


def tree(volume: Path, base: int, known: dict[str, str] | None = None) -> dict[str, str]:
    """Every captured entry of ``volume`` (a sandbox's subvolume or a snapshot):
    ``{"workspace/a.txt": "f 644 0:0 6 <sha256>", …}``. The caller keeps the tree
    still (frozen sandbox, read-only snapshot, or not yet started). ``known``: file
    hashes that need not be computed again (see ``_entry``): only metadata is read."""
    known = known or {}
    out: dict[str, str] = {}
    for part in CAPTURED:
        top = volume / part
        if not os.path.lexists(top):
            continue  # a host sandbox has no root/upper
        out[part] = _entry(top, os.lstat(top), base, known.get(part))
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in [*dirnames, *sorted(filenames)]:
                path = Path(dirpath, name)
                rel = str(path.relative_to(volume))
                out[rel] = _entry(path, os.lstat(path), base, known.get(rel))
    return out


def fingerprint(entries: dict[str, str]) -> str:
    """The tree hash: sha256 of every ``path\\0entry\\n``, paths sorted."""
    h = hashlib.sha256()
    for path in sorted(entries):
        h.update(os.fsencode(path) + b"\0" + entries[path].encode() + b"\n")
    return f"sha256:{h.hexdigest()}"


def file_bytes(entries: dict[str, str]) -> int:
    return sum(int(e.split(" ")[3]) for e in entries.values() if e.startswith("f "))


def diff(
    expected: dict[str, str], actual: dict[str, str], limit: int = 100
) -> list[dict[str, Any]]:
    """What differs, path by path (at most ``limit`` paths, sorted): ``{"path",
    "expected", "actual"}`` with null for a side that lacks the path."""
    out: list[dict[str, Any]] = []
    for path in sorted(expected.keys() | actual.keys()):
        want, got = expected.get(path), actual.get(path)
        if want != got:
            out.append({"path": path, "expected": want, "actual": got})
            if len(out) >= limit:
                break
    return out


def shift_owners(volume: Path, old_base: int, new_base: int) -> int:
    """Moves every entry owned by ``old_base..+RANGE`` to the same id above
    ``new_base`` (lchown; set-id bits the kernel clears on chown are put back).
    Returns the number of entries changed. Owners outside the range (the overlay's
    own work dirs, root-owned) are left alone."""
    if old_base == new_base:
        return 0

    def moved(ident: int) -> int:
        rel = ident - old_base
        return new_base + rel if 0 <= rel < USERNS_RANGE else ident

    changed = 0
    for dirpath, dirnames, filenames in os.walk(volume):
        for name in ["", *dirnames, *filenames]:
            path = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(path)
            uid, gid = moved(st.st_uid), moved(st.st_gid)
            if (uid, gid) == (st.st_uid, st.st_gid):
                continue
            os.lchown(path, uid, gid)
            if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode))
            changed += 1
    return changed
