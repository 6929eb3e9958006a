"""The image config's ``User`` as numeric ids, looked up in the image's own files.

OCI ``User`` is ``user``, ``uid``, ``user:group``, ``uid:gid`` (or mixed). Names are
resolved against the image's ``/etc/passwd`` and ``/etc/group`` as the merged layers
show them (topmost layer first, whiteouts and opaque dirs honoured), without mounting
anything. A numeric uid absent from passwd runs with gid 0, as Docker does; an unknown
name is an error (running as root instead would be a silent fallback).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ImageError

OPAQUE_XATTR = "trusted.overlay.opaque"


class ImageUserUnknown(ImageError):
    code = "image_user_unknown"


def _is_whiteout(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def read_merged(lower_dirs: list[Path], rel: str) -> bytes | None:
    """The content of rel (a regular file, no symlink followed) as the overlay of
    lower_dirs (topmost first) would show it, or None."""
    parts = [p for p in rel.split("/") if p]
    for layer in lower_dirs:
        hidden_below = False
        for i in range(1, len(parts) + 1):
            p = layer.joinpath(*parts[:i])
            if _is_whiteout(p):
                return None
            if i < len(parts) and _is_opaque(p):
                hidden_below = True
        target = layer.joinpath(*parts)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            if hidden_below:
                return None
            continue
        if not stat.S_ISREG(st.st_mode):
            return None
        return target.read_bytes()
    return None


def _table(lower_dirs: list[Path], rel: str) -> list[list[str]]:
    data = read_merged(lower_dirs, rel) or b""
    rows = []
    for line in data.decode("utf-8", "replace").splitlines():
        if line and not line.startswith("#"):
            rows.append(line.split(":"))
    return rows


def resolve_user(reference: str, lower_dirs: list[Path], user: str) -> tuple[int, int]:
    """(uid, gid) for an image config's User."""
    if not user:
        return 0, 0
    name, _, group = user.partition(":")
    passwd = _table(lower_dirs, "etc/passwd")
    if name.isdigit():
        uid = int(name)
        entry = next((r for r in passwd if len(r) > 3 and r[2] == name), None)
    else:
        entry = next((r for r in passwd if len(r) > 3 and r[0] == name), None)
        if entry is None or not entry[2].isdigit():
            raise ImageUserUnknown(reference, f"user {name!r} is not in the image's /etc/passwd")
        uid = int(entry[2])
    gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            row = next((r for r in _table(lower_dirs, "etc/group") if r[0] == group), None)
            if row is None or len(row) < 3 or not row[2].isdigit():
                raise ImageUserUnknown(
                    reference, f"group {group!r} is not in the image's /etc/group"
                )
            gid = int(row[2])
    return uid, gid
