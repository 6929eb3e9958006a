"""Sandbox storage: every sandbox's writable data on one bounded filesystem.

One btrfs per instance, on a sparse file under the state dir, loop-mounted
``nosuid,nodev`` at ``<state_dir>/storage``: whatever the sandboxes write, the host
filesystem holding it (and Postgres, the logs) loses at most the file's size. Each
sandbox's data is one subvolume ``<mount>/<sandbox_id>`` (``workspace/``, ``tmp/``,
and later the images issue's overlay upper dirs) inside a level-1 quota group with a
limit: writes past it fail with EDQUOT in the sandbox, the other sandboxes go on.

The btrfs is mounted on top of a *shared* bind of ``<state_dir>/storage`` onto itself
(as the backend does for its roots dir): host ``/`` is a private mount, so a mount
namespace cloned later (a zygote launcher) would otherwise keep a private copy of the
btrfs, busy, and its loop device stayed attached after ``release``. On the shared bind
the btrfs is shared with those copies and its unmount propagates to them.

Per provision this costs three ioctls (group create, group limit, subvolume create)
and two mkdirs; per destroy about four. Mounting (and, the first time, creating) the
filesystem is done once, by the first provision that finds it unmounted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from apps.sandboxes.backends.base import BackendError

from . import _btrfs
from ._sys import SYSTEM_PATH, file_lock, run

log = logging.getLogger(__name__)

AUTO_MAX_BYTES = 64 << 30  # auto size: at most this ...
AUTO_FREE_FRACTION = 0.5  # ... and at most this fraction of the free space
MIN_BYTES = 256 << 20  # btrfs needs ~120 MiB for itself
_LOOP_CLR_FD = 0x4C01

MS_BIND = 0x1000
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.syncfs.argtypes = [ctypes.c_int]


@dataclass(frozen=True)
class Volume:
    """One sandbox's data on the storage: bind ``workspace`` and ``tmp`` from here."""

    root: Path
    qgroup: str  # "1/<n>"
    limit_bytes: int

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"


def qgroup_of(sandbox_id: str) -> int:
    """The sandbox's quota group id: derived from its id, so destroy needs no meta."""
    digest = hashlib.sha1(sandbox_id.encode(), usedforsecurity=False).hexdigest()
    return _btrfs.qgroupid(1, int(digest[:12], 16))


class Storage:
    def __init__(self, state_dir: Path, size_bytes: int = 0) -> None:
        self.image = state_dir / "storage.img"
        self.mount = state_dir / "storage"
        self.lock = state_dir / "locks" / "storage.lock"
        self.size_bytes = size_bytes  # 0: auto (AUTO_MAX_BYTES / AUTO_FREE_FRACTION)
        self._dev: int | None = None  # st_dev of the mount this process last saw
        self._sysfs: Path | None = None

    # ---- the filesystem ------------------------------------------------------------

    def mounted(self) -> bool:
        """One stat: the mount point is a btrfs top-level subvolume root, not a dir."""
        try:
            st = os.stat(self.mount)
            parent = os.stat(self.mount.parent)
        except FileNotFoundError:
            return False
        return st.st_dev != parent.st_dev and st.st_ino == _btrfs.SUBVOL_ROOT_INO

    def ensure(self) -> bool:
        """Mounts the storage (creating it the first time); True if it mounted it now.

        No fallback: without a loop device, btrfs or simple quotas this raises
        BackendError naming the cause, and no sandbox starts on unbounded host dirs.
        """
        if self._dev is not None and self.mounted():
            return False
        with file_lock(self.lock):
            if self.mounted():
                self._dev = os.stat(self.mount).st_dev
                return False
            fresh = not self.image.exists()
            if fresh:
                self._create_image()
            self.mount.mkdir(mode=0o711, exist_ok=True)
            self._share_mount_point()
            # util-linux sets up the loop device with autoclear: it is released when
            # the filesystem is unmounted (teardown, `make down`).
            proc = run(
                [
                    "mount",
                    "-t",
                    "btrfs",
                    "-o",
                    "loop,nosuid,nodev,noatime,discard=async",
                    str(self.image),
                    str(self.mount),
                ],
                check=False,
            )
            if proc.returncode != 0:
                raise BackendError(
                    f"sandbox storage: cannot loop-mount {self.image} on {self.mount} "
                    f"(a free loop device and btrfs are needed): {proc.stderr.strip()}"
                )
            try:
                self._sysfs = _btrfs.sysfs_dir(self.mount)
                if not (self._sysfs / "qgroups").is_dir():
                    _btrfs.enable_simple_quota(self.mount)
                # search only (no listing): bwrap runs as the sandbox's unprivileged
                # host id and must reach <mount>/<sid>/workspace to bind it
                os.chmod(self.mount, 0o711)  # noqa: S103 - search only, see above
            except OSError as exc:
                self._umount()
                raise BackendError(
                    f"sandbox storage: cannot enable btrfs simple quotas on {self.image} "
                    f"(needs Linux >= 6.7): {exc}"
                ) from exc
            self._dev = os.stat(self.mount).st_dev
            log.info("sandbox storage mounted at %s (%s)", self.mount, self.image)
            return True

    def _share_mount_point(self) -> None:
        """``<state_dir>/storage`` as a shared bind mount of itself (once per boot)."""
        if _mount_lines(self.mount):
            return  # the bind (or a btrfs on it) is there
        target = os.fsencode(self.mount)
        if _libc.mount(target, target, None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            raise BackendError(f"cannot bind-mount {self.mount}: {os.strerror(err)}")
        if _libc.mount(None, target, None, MS_SHARED, None) != 0:
            err = ctypes.get_errno()
            _libc.umount2(target, MNT_DETACH)
            raise BackendError(f"cannot make {self.mount} shared: {os.strerror(err)}")

    def _create_image(self) -> None:
        size = self.size_bytes or self._auto_size()
        if size < MIN_BYTES:
            raise BackendError(f"sandbox storage: {size} bytes is too small (min {MIN_BYTES})")
        if shutil.which("mkfs.btrfs", path=SYSTEM_PATH) is None:
            raise BackendError("sandbox storage: mkfs.btrfs is missing (Debian: btrfs-progs)")
        tmp = self.image.with_name(f".{self.image.name}.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.truncate(size)  # sparse: host blocks are used only as sandboxes write
            # -K: no discard of a file that is all holes; single profiles: one device
            run(["mkfs.btrfs", "-q", "-f", "-K", "-m", "single", "-d", "single", str(tmp)])
            os.replace(tmp, self.image)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _auto_size(self) -> int:
        st = os.statvfs(self.image.parent)
        return min(AUTO_MAX_BYTES, int(st.f_bavail * st.f_frsize * AUTO_FREE_FRACTION))

    def size(self) -> int:
        """Bytes of the mounted filesystem."""
        st = os.statvfs(self.mount)
        return st.f_blocks * st.f_frsize

    def sysfs(self) -> Path:
        if self._sysfs is None:
            self._sysfs = _btrfs.sysfs_dir(self.mount)
        return self._sysfs

    # ---- per sandbox ---------------------------------------------------------------

    def create(self, sandbox_id: str, limit_bytes: int) -> Volume:
        """The sandbox's subvolume in its own quota group limited to ``limit_bytes``
        (at most the filesystem's size). ``workspace/`` and ``tmp/`` (1777) in it."""
        limit = min(limit_bytes, self.size())
        qid = qgroup_of(sandbox_id)
        if os.path.lexists(self.mount / sandbox_id):
            # left by a destroy that ran while the storage was unmounted
            self.remove(sandbox_id)
        try:
            with contextlib.suppress(FileExistsError):
                # a leftover of this sandbox id's own earlier life (a destroy that
                # died halfway): reused, its limit set again below
                _btrfs.create_qgroup(self.mount, qid)
            _btrfs.limit_qgroup(self.mount, qid, limit)
            _btrfs.create_subvolume(self.mount, sandbox_id, qid)
        except OSError as exc:
            msg = f"sandbox storage: cannot create {sandbox_id}'s volume: {exc}"
            raise BackendError(msg) from exc
        root = self.mount / sandbox_id
        (root / "workspace").mkdir()
        (root / "tmp").mkdir()
        os.chmod(root / "tmp", 0o1777)  # noqa: S103 - a /tmp must be world-writable + sticky
        return Volume(root, _btrfs.qgroup_name(qid), limit)

    def restore(self, sandbox_id: str, limit_bytes: int, snapshot: Path) -> Volume:
        """The sandbox's subvolume as a writable copy-on-write snapshot of
        ``snapshot`` (one of ``snapshots_dir``), in its own limited quota group: only
        what the sandbox writes from now on is charged to it. The overlay's work dir
        is made empty (kernel scratch space, never state)."""
        limit = min(limit_bytes, self.size())
        qid = qgroup_of(sandbox_id)
        if os.path.lexists(self.mount / sandbox_id):
            self.remove(sandbox_id)
        try:
            with contextlib.suppress(FileExistsError):
                _btrfs.create_qgroup(self.mount, qid)
            _btrfs.limit_qgroup(self.mount, qid, limit)
            _btrfs.snapshot_subvolume(snapshot, self.mount, sandbox_id, readonly=False, qid=qid)
        except OSError as exc:
            msg = (
                f"sandbox storage: cannot restore {sandbox_id}'s volume from {snapshot.name}: {exc}"
            )
            raise BackendError(msg) from exc
        root = self.mount / sandbox_id
        work = root / "root" / "work"
        if work.is_dir():
            shutil.rmtree(work)
            work.mkdir(mode=0o755)
        return Volume(root, _btrfs.qgroup_name(qid), limit)

    # ---- snapshots (snapshots.py) ----------------------------------------------------

    @property
    def snapshots_dir(self) -> Path:
        return self.mount / ".snapshots"

    def flush(self) -> None:
        """Writes the storage's dirty data out (syncfs): done before a sandbox is frozen
        for a capture, so the snapshot inside the freeze flushes only what was written
        since (a GiB written just before would otherwise keep it frozen for seconds)."""
        fd = os.open(self.mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise BackendError(f"cannot sync {self.mount}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def capture(self, sandbox_id: str, snapshot_id: str) -> Path:
        """A read-only snapshot of the sandbox's subvolume at
        ``snapshots_dir/<snapshot_id>``. The caller has frozen the sandbox; btrfs
        flushes the subvolume's dirty data into the snapshot itself."""
        self.snapshots_dir.mkdir(mode=0o700, exist_ok=True)
        target = self.snapshots_dir / snapshot_id
        try:
            _btrfs.snapshot_subvolume(
                self.mount / sandbox_id, self.snapshots_dir, snapshot_id, readonly=True
            )
        except OSError as exc:
            raise BackendError(f"cannot snapshot {sandbox_id}'s volume: {exc}") from exc
        return target

    def snapshot_ctransid(self, snapshot_id: str) -> int:
        """The last transaction that changed the snapshot's contents (_btrfs)."""
        path = self.snapshots_dir / snapshot_id
        try:
            return _btrfs.subvolume_ctransid(path)
        except OSError as exc:
            raise BackendError(f"cannot read snapshot {snapshot_id}: {exc}") from exc

    def drop_snapshot(self, snapshot_id: str) -> None:
        """Deletes the snapshot's subvolume. Idempotent."""
        if not self.mounted():
            return
        target = self.snapshots_dir / snapshot_id
        if not os.path.lexists(target):
            return
        try:
            _btrfs.delete_subvolume(self.snapshots_dir, snapshot_id)
        except OSError as exc:
            raise BackendError(f"cannot delete snapshot {snapshot_id}: {exc}") from exc

    def remove(self, sandbox_id: str) -> None:
        """Deletes the sandbox's subvolume (and any it made inside) and its quota
        group. Idempotent; the sandbox's processes must be dead."""
        if not self.mounted():
            return  # its data waits on the unmounted image; inventory finds it mounted
        qid = qgroup_of(sandbox_id)
        root = self.mount / sandbox_id
        try:
            # Deleting needs a little metadata space, charged to the group: a
            # sandbox that filled its quota could not be deleted under its limit.
            with contextlib.suppress(FileNotFoundError):
                _btrfs.limit_qgroup(self.mount, qid, None)
            if os.path.lexists(root):
                self._delete_volume(root, qid)
            with contextlib.suppress(FileNotFoundError):
                _btrfs.delete_qgroup(self.mount, qid)
        except OSError as exc:
            msg = f"sandbox storage: cannot remove {sandbox_id}'s volume: {exc}"
            raise BackendError(msg) from exc

    def _delete_volume(self, root: Path, qid: int) -> None:
        if os.lstat(root).st_ino != _btrfs.SUBVOL_ROOT_INO:
            shutil.rmtree(root)  # not a subvolume: nothing of ours, but in our namespace
            return
        top = _btrfs.subvolume_id(root)
        try:
            _btrfs.delete_subvolume(root.parent, root.name)
            members = [top]
        except OSError as exc:
            if not _btrfs.is_enotempty(exc):
                raise
            # the sandbox made subvolumes of its own (in its group, by inheritance)
            members = []
            for nested in _btrfs.nested_subvolumes(root):
                members.append(_btrfs.subvolume_id(nested))
                _btrfs.delete_subvolume(nested.parent, nested.name)
            _btrfs.delete_subvolume(root.parent, root.name)
            members.append(top)
        # A deleted subvolume's group lives until the kernel has freed its extents;
        # unlinked now, our group can go at once.
        for member in members:
            with contextlib.suppress(FileNotFoundError):
                _btrfs.unassign_qgroup(self.mount, _btrfs.qgroupid(0, member), qid)

    def usage(self, sandbox_id: str) -> int | None:
        """Bytes the sandbox's data uses (its quota group's), None if unknown."""
        if not self.mounted():
            return None
        qid = qgroup_of(sandbox_id)
        level, _, ident = _btrfs.qgroup_name(qid).partition("/")
        try:
            return int((self.sysfs() / "qgroups" / f"{level}_{ident}" / "referenced").read_text())
        except (OSError, ValueError):
            return None

    def quota_files(self, sandbox_id: str) -> dict[str, list[str]]:
        """The sysfs files of the sandbox's quota group the agent reads to name a full
        disk (podagent/limits.py): usage, reservations, limit. Empty if not mounted."""
        if not self.mounted():
            return {}
        level, _, ident = _btrfs.qgroup_name(qgroup_of(sandbox_id)).partition("/")
        group = self.sysfs() / "qgroups" / f"{level}_{ident}"
        if not (group / "max_referenced").exists():
            return {}
        return {
            "disk_used": [str(group / "referenced")],
            "disk_rsv": [str(group / "rsv_data")] if (group / "rsv_data").exists() else [],
            "disk_max": [str(group / "max_referenced")],
        }

    # ---- inventory -----------------------------------------------------------------

    def volumes(self) -> list[str]:
        """Sandbox ids with a subvolume on the storage (none when it is not mounted)."""
        if not self.mounted():
            return []
        return sorted(p.name for p in self.mount.iterdir() if not p.name.startswith("."))

    def qgroups(self) -> list[int]:
        if not self.mounted():
            return []
        return sorted(_btrfs.level1_qgroups(self.sysfs()))

    def delete_qgroup(self, qid: int) -> None:
        if not self.mounted():
            return
        try:
            _btrfs.delete_qgroup(self.mount, qid)
        except FileNotFoundError:
            pass
        except OSError as exc:
            msg = f"cannot delete quota group {_btrfs.qgroup_name(qid)}: {exc}"
            raise BackendError(msg) from exc

    def stray_loops(self) -> list[str]:
        """Loop devices backed by this storage's image that hold no mount of it: left
        by a process killed between attaching and mounting, or by a lazy unmount."""
        mounted = self._mounted_device()
        found: list[str] = []
        for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
            try:
                path = backing.read_text().strip().removesuffix(" (deleted)")
            except OSError:
                continue
            device = "/dev/" + backing.parent.parent.name
            if path == str(self.image) and device != mounted:
                found.append(device)
        return sorted(found)

    def detach_loop(self, device: str) -> None:
        if device not in self.stray_loops():
            return  # gone, or not one of ours
        try:
            fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            fcntl.ioctl(fd, _LOOP_CLR_FD)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # already detached
                raise BackendError(f"cannot detach {device}: {exc}") from exc
        finally:
            os.close(fd)

    def _mounted_device(self) -> str | None:
        """The source of the topmost mount at the mount point: the loop device when the
        btrfs is mounted (the shared bind under it is not a device of ours)."""
        lines = _mount_lines(self.mount)
        if not self.mounted() or not lines:
            return None
        return lines[-1].split(" - ", 1)[1].split(" ")[1]

    # ---- teardown ------------------------------------------------------------------

    def release(self) -> None:
        """Unmounts the storage (its loop device goes with it); the image stays for
        the next start (`make down`). Sandboxes must be destroyed first."""
        with file_lock(self.lock):
            self._umount()
            for device in self.stray_loops():
                self.detach_loop(device)
        self._dev = None
        self._sysfs = None

    def teardown(self) -> None:
        """Unmounts and deletes the storage (tests, uninstall)."""
        self.release()
        with file_lock(self.lock):
            # the shared bind under it (whatever still uses it keeps its view)
            while _mount_lines(self.mount):
                if _libc.umount2(os.fsencode(self.mount), MNT_DETACH) != 0:
                    break
        with contextlib.suppress(FileNotFoundError):
            self.image.unlink()
        with contextlib.suppress(FileNotFoundError, OSError):
            self.mount.rmdir()

    def _umount(self) -> None:
        while self.mounted():
            if _libc.umount2(str(self.mount).encode(), 0) != 0:
                err = ctypes.get_errno()
                raise BackendError(f"cannot unmount {self.mount}: {os.strerror(err)}")


def _mount_lines(path: Path) -> list[str]:
    """This namespace's mountinfo lines whose mount point is ``path``, bottom first."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    return [line for line in lines if " - " in line and line.split(" ")[4:5] == [str(path)]]
