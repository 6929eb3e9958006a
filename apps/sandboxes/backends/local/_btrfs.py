"""The few btrfs ioctls sandbox storage needs, called from this process.

Per sandbox: a subvolume created inside a level-1 quota group with a limit, and on
destroy the subvolume deleted and the group removed. Each is one ioctl of well under
a millisecond, so a provision starts no process for its disk quota.

Simple quotas (kernel >= 6.7) rather than full qgroups: every new subvolume inherits
the quota groups of the subvolume it is created in. A sandbox may create subvolumes
(any user may, in a directory it can write) and snapshots; with full qgroups their
data would count against no limit of ours, with simple quotas it counts against the
sandbox's group. Struct layouts are those of ``linux/btrfs.h``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from pathlib import Path

BTRFS_SUPER_MAGIC = 0x9123683E
SUBVOL_ROOT_INO = 256  # BTRFS_FIRST_FREE_OBJECTID: every subvolume's root directory


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_W, _R, _WR = 1, 2, 3
_SNAP_DESTROY = _ioc(_W, 15, 4096)  # struct btrfs_ioctl_vol_args
_INO_LOOKUP = _ioc(_WR, 18, 4096)  # struct btrfs_ioctl_ino_lookup_args
_SNAP_CREATE_V2 = _ioc(_W, 23, 4096)  # struct btrfs_ioctl_vol_args_v2
_SUBVOL_CREATE_V2 = _ioc(_W, 24, 4096)  # struct btrfs_ioctl_vol_args_v2
_GET_SUBVOL_INFO = _ioc(_R, 60, 504)  # struct btrfs_ioctl_get_subvol_info_args
_QUOTA_CTL = _ioc(_WR, 40, 16)
_QGROUP_ASSIGN = _ioc(_W, 41, 24)
_QGROUP_CREATE = _ioc(_W, 42, 16)
_QGROUP_LIMIT = _ioc(_R, 43, 48)

_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4
_SUBVOL_RDONLY = 1 << 1
_SUBVOL_QGROUP_INHERIT = 1 << 2
_LIMIT_MAX_RFER = 1
_LIMIT_MAX_EXCL = 2


def qgroupid(level: int, ident: int) -> int:
    return (level << 48) | ident


def qgroup_name(qid: int) -> str:
    return f"{qid >> 48}/{qid & ((1 << 48) - 1)}"


def _dirfd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _vol_args(name: str) -> bytearray:
    return bytearray(struct.pack("q", 0) + name.encode().ljust(4088, b"\0"))


def enable_simple_quota(mount: Path) -> None:
    fd = _dirfd(mount)
    try:
        fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0)))
    finally:
        os.close(fd)


def create_qgroup(fs: Path, qid: int) -> None:
    """Raises FileExistsError if the group exists."""
    fd = _dirfd(fs)
    try:
        fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("QQ", 1, qid)))
    finally:
        os.close(fd)


def delete_qgroup(fs: Path, qid: int) -> None:
    """Raises FileNotFoundError if it is gone, OSError(EBUSY) while it has members."""
    fd = _dirfd(fs)
    try:
        fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("QQ", 0, qid)))
    finally:
        os.close(fd)


def limit_qgroup(fs: Path, qid: int, max_bytes: int | None) -> None:
    """Referenced and exclusive bytes of ``qid`` at most ``max_bytes``; None: no limit."""
    flags = _LIMIT_MAX_RFER | _LIMIT_MAX_EXCL
    value = (1 << 64) - 1 if max_bytes is None else max_bytes  # -1 clears a limit
    fd = _dirfd(fs)
    try:
        args = struct.pack("Q5Q", qid, flags, value, value, 0, 0)
        fcntl.ioctl(fd, _QGROUP_LIMIT, bytearray(args))
    finally:
        os.close(fd)


def unassign_qgroup(fs: Path, child: int, parent: int) -> None:
    fd = _dirfd(fs)
    try:
        fcntl.ioctl(fd, _QGROUP_ASSIGN, bytearray(struct.pack("QQQ", 0, child, parent)))
    finally:
        os.close(fd)


def create_subvolume(parent: Path, name: str, qid: int) -> None:
    """Subvolume ``parent/name`` created as a member of quota group ``qid``."""
    # struct btrfs_qgroup_inherit: flags, num_qgroups, num_ref_copies,
    # num_excl_copies, struct btrfs_qgroup_limit (5 x u64), then the group ids
    raw = struct.pack("4Q5QQ", 0, 1, 0, 0, 0, 0, 0, 0, 0, qid)
    inherit = ctypes.create_string_buffer(raw, len(raw))  # the kernel checks the size
    args = struct.pack("qQQQQ", 0, 0, _SUBVOL_QGROUP_INHERIT, len(raw), ctypes.addressof(inherit))
    args += b"\0" * 16 + name.encode().ljust(4040, b"\0")
    fd = _dirfd(parent)
    try:
        fcntl.ioctl(fd, _SUBVOL_CREATE_V2, bytearray(args))
    finally:
        os.close(fd)


def snapshot_subvolume(
    source: Path, parent: Path, name: str, *, readonly: bool, qid: int | None = None
) -> None:
    """``parent/name`` becomes a copy-on-write snapshot of subvolume ``source`` (one
    ioctl; the data is shared until either side writes). ``qid``: a quota group the
    snapshot joins (with simple quotas only what it writes later is charged to it: the
    shared extents stay charged to the subvolume that wrote them)."""
    flags = _SUBVOL_RDONLY if readonly else 0
    inherit = None
    size, addr = 0, 0
    if qid is not None:
        raw = struct.pack("4Q5QQ", 0, 1, 0, 0, 0, 0, 0, 0, 0, qid)
        inherit = ctypes.create_string_buffer(raw, len(raw))
        flags |= _SUBVOL_QGROUP_INHERIT
        size, addr = len(raw), ctypes.addressof(inherit)
    src = _dirfd(source)
    try:
        args = struct.pack("qQQQQ", src, 0, flags, size, addr)
        args += b"\0" * 16 + name.encode().ljust(4040, b"\0")
        fd = _dirfd(parent)
        try:
            fcntl.ioctl(fd, _SNAP_CREATE_V2, bytearray(args))
        finally:
            os.close(fd)
    finally:
        os.close(src)
    del inherit  # kept alive until the ioctl returned


def subvolume_ctransid(path: Path) -> int:
    """The transaction that last changed anything in the subvolume ``path`` (any
    inode: data, owner, mode, a new or removed name). Unlike its generation, it does
    not move when the subvolume is snapshotted or its read-only flag toggled."""
    fd = _dirfd(path)
    try:
        args = bytearray(504)
        fcntl.ioctl(fd, _GET_SUBVOL_INFO, args)
        # treeid, name[256], parent_id, dirid, generation, flags, 3 uuids, then ctransid
        return int(struct.unpack_from("Q", args, 8 + 256 + 8 + 8 + 8 + 8 + 48)[0])
    finally:
        os.close(fd)


def subvolume_id(path: Path) -> int:
    """The id (tree id) of the subvolume ``path`` is in."""
    fd = _dirfd(path)
    try:
        args = bytearray(struct.pack("QQ", 0, SUBVOL_ROOT_INO) + b"\0" * 4080)
        fcntl.ioctl(fd, _INO_LOOKUP, args)
        return int(struct.unpack_from("Q", args)[0])
    finally:
        os.close(fd)


def delete_subvolume(parent: Path, name: str) -> None:
    """Deletes subvolume ``parent/name`` with its contents (the kernel frees its
    extents in the background). Raises OSError(ENOTEMPTY) if subvolumes are nested
    in it: see ``nested_subvolumes``."""
    fd = _dirfd(parent)
    try:
        fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(name))
    finally:
        os.close(fd)


def nested_subvolumes(root: Path) -> list[Path]:
    """Subvolumes below ``root``, deepest first (the order they can be deleted in).

    Only called on a sandbox whose processes are all dead: nothing renames under it.
    """
    found: list[Path] = []
    top_dev = os.lstat(root).st_dev
    for dirpath, dirnames, _files in os.walk(root, topdown=True, followlinks=False):
        for name in dirnames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            if st.st_ino == SUBVOL_ROOT_INO and st.st_dev != top_dev:
                found.append(path)
    # a nested one's own nested ones sit below it, so longer paths go first
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def is_enotempty(exc: OSError) -> bool:
    return exc.errno == errno.ENOTEMPTY


_FS_INFO = _ioc(_R, 31, 1024)  # struct btrfs_ioctl_fs_info_args: fsid at offset 16


def sysfs_dir(mount: Path) -> Path:
    """``/sys/fs/btrfs/<fsid>`` of the filesystem mounted at ``mount``."""
    fd = _dirfd(mount)
    try:
        args = bytearray(1024)
        fcntl.ioctl(fd, _FS_INFO, args)
    finally:
        os.close(fd)
    raw = bytes(args[16:32]).hex()
    fsid = f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"
    return Path("/sys/fs/btrfs") / fsid


def level1_qgroups(sysfs: Path) -> dict[int, int]:
    """Every level-1 quota group's id and referenced bytes."""
    found: dict[int, int] = {}
    try:
        entries = list((sysfs / "qgroups").iterdir())
    except FileNotFoundError:
        return found
    for entry in entries:
        level, _, ident = entry.name.partition("_")
        if level != "1" or not ident.isdigit():
            continue
        try:
            used = int((entry / "referenced").read_text())
        except (OSError, ValueError):
            continue  # deleted while listed
        found[qgroupid(1, int(ident))] = used
    return found
