"""A sandbox's root: overlayfs over idmapped image layers, with a private upper dir.

The layers are unpacked once with their real owners (uid 0 = root) and shared by every
sandbox. A sandbox runs in a user namespace that maps its root to an unprivileged host
range (BASE..BASE+65535). Each lower layer is given to overlayfs as an **idmapped
mount** made with that user namespace (``open_tree(OPEN_TREE_CLONE)`` +
``mount_setattr(MOUNT_ATTR_IDMAP)``): a file owned by 0 on disk is seen as BASE on the
host, so as 0 inside the sandbox. The upper dir holds plain host ids (BASE+n): what the
sandbox writes is copied up there, the layers are never touched.

The overlay itself is built with the new mount API (``fsopen("overlay")`` and one
``lowerdir+`` per layer, kernel ≥ 6.8): no option-string length limit on the number of
layers. The detached idmapped layer mounts are handed to overlayfs as paths under
``/proc/self/fd/N``, so nothing is ever attached to a visible path, and nothing is
left to unmount but the overlay.

x86_64 syscall numbers; the kernel here is 6.18 (docs/images.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(nr: int, *args: object) -> int:
    # syscall(2) is variadic: pass every integer as a full long
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return int(_libc.syscall(ctypes.c_long(nr), *conv))


SYS_open_tree = 428
SYS_move_mount = 429
SYS_fsopen = 430
SYS_fsconfig = 431
SYS_fsmount = 432
SYS_mount_setattr = 442

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000
FSOPEN_CLOEXEC = 1
FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6


class MountError(OSError):
    """A mount step failed; the message names the step and the kernel's errno."""


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, step: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{step}: {os.strerror(err)}")
    return ret


def idmapped_tree(path: Path, userns_fd: int) -> int:
    """A detached, read-only, idmapped clone of the mount at path (an fd)."""
    fd = _check(
        _syscall(
            SYS_open_tree,
            AT_FDCWD,
            os.fsencode(path),
            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC,
        ),
        f"open_tree({path})",
    )
    attr = _MountAttr(
        attr_set=MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV,
        userns_fd=userns_fd,
    )
    try:
        _check(
            _syscall(
                SYS_mount_setattr,
                fd,
                b"",
                AT_EMPTY_PATH,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            ),
            f"mount_setattr(MOUNT_ATTR_IDMAP, {path})",
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsconfig(fs: int, key: str, value: str | None) -> None:
    if value is None:
        _check(
            _syscall(SYS_fsconfig, fs, FSCONFIG_SET_FLAG, key.encode(), None, 0),
            f"fsconfig({key})",
        )
    else:
        _check(
            _syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0),
            f"fsconfig({key}={value})",
        )


@contextlib.contextmanager
def _closing(fds: list[int]) -> Iterator[list[int]]:
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def mount_rootfs(layers: list[Path], upper: Path, work: Path, target: Path, userns_fd: int) -> None:
    """Mount at target an overlay of layers (topmost first, as ImageStore.lower_dirs
    gives them) seen through userns_fd's id mapping, writable into upper.

    upper and work must be empty dirs on one filesystem, owned by the mapping's root
    (BASE) so that the sandbox's root owns its root directory. Undo with
    ``umount2(target, MNT_DETACH)`` (``unmount_rootfs``).
    """
    if not layers:
        raise ValueError("an image has at least one layer")
    with _closing([]) as fds:
        for layer in layers:
            fds.append(idmapped_tree(layer, userns_fd))
        fs = _check(_syscall(SYS_fsopen, b"overlay", FSOPEN_CLOEXEC), "fsopen(overlay)")
        fds.append(fs)
        for fd in fds[:-1]:
            # a detached mount is reachable through its fd: overlayfs resolves the
            # path when it is configured, and holds the mount from then on
            _fsconfig(fs, "lowerdir+", f"/proc/self/fd/{fd}")
        _fsconfig(fs, "upperdir", str(upper))
        _fsconfig(fs, "workdir", str(work))
        # without an index or redirects a copied-up dir stays tied to nothing but
        # its path: the layers may be shared by any number of overlays
        _fsconfig(fs, "redirect_dir", "off")
        _fsconfig(fs, "index", "off")
        _fsconfig(fs, "metacopy", "off")
        _check(_syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, None, None, 0), "create overlay")
        mnt = _check(
            _syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV), "fsmount(overlay)"
        )
        fds.append(mnt)
        _check(
            _syscall(
                SYS_move_mount,
                mnt,
                b"",
                AT_FDCWD,
                os.fsencode(target),
                MOVE_MOUNT_F_EMPTY_PATH,
            ),
            f"move_mount(overlay → {target})",
        )


MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000


def userns_fd(base: int, count: int = 65536) -> int:
    """An fd of a new user namespace mapping 0..count-1 to base..base+count-1.

    The integration passes the sandbox's own user namespace instead; this one serves
    the tests and any caller that mounts before the sandbox exists (an id mapping
    is all an idmapped mount takes from the namespace). A forked child unshares, the
    parent writes its maps and keeps a reference by opening its ns file.
    """
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only async-signal-safe work until _exit
        code = 0
        try:
            os.close(ready_r)
            os.close(done_w)
            code = 0 if _libc.unshare(CLONE_NEWUSER) == 0 else 1
            os.write(ready_w, b"1" if code == 0 else b"0")
            os.read(done_r, 1)
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise MountError(1, "unshare(CLONE_NEWUSER) failed")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {base} {count}\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.waitpid(pid, 0)


def unmount_rootfs(target: Path) -> None:
    _check(_libc.umount2(os.fsencode(target), MNT_DETACH), f"umount2({target})")
