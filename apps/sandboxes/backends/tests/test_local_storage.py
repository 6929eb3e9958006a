"""Sandbox storage: a sandbox cannot fill the host's disk (issue 14, finding 5).

Each isolated sandbox's /workspace and /tmp are one btrfs subvolume in a quota group
on the instance's loop-mounted storage (``storage.py``); these tests write past the
quota from inside real sandboxes and check the host's root filesystem from outside.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import BackendError, DiskExhausted, InventoryItem
from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, _btrfs
from apps.sandboxes.backends.local.storage import qgroup_of

from .conftest import PODAGENT, Sandbox, make_config, needs_root, new_spec, searchable

pytestmark = needs_root

MiB = 1 << 20

# Writes MiB chunks to a file until the write fails or LIMIT MiB are written; prints
# the errno's name (or "none") and how many bytes made it.
FILL = (
    "import errno,os,sys\n"
    "path, limit = sys.argv[1], int(sys.argv[2])\n"
    "done, err = 0, 'none'\n"
    "try:\n"
    "    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)\n"
    "    while done < limit << 20:\n"
    "        done += os.write(fd, b'x' * (1 << 20))\n"
    "    os.fsync(fd)\n"
    "except OSError as e:\n"
    "    err = errno.errorcode.get(e.errno, str(e.errno))\n"
    "print(err, done)\n"
)


def fill(sb: Sandbox, path: str, mib: int) -> tuple[str, int]:
    r = sb.exec(["python3", "-c", FILL, path, str(mib)], timeout=120)
    assert r["termination"]["exit_code"] == 0, r
    err, done = r["stdout"]["head"].split()
    return err, int(done)


def host_free(path: str = "/") -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def private_backend(tmp_path: Path, tag: str, disk_size_mib: int = 512) -> LocalBackend:
    return LocalBackend(
        LocalBackendConfig(
            state_dir=searchable(tmp_path) / "state",
            instance=f"{tag}{os.getpid()}",
            podagent_dir=PODAGENT,
            isolation="netns",
            disk_size_mib=disk_size_mib,
        )
    )


def loops_of(image: Path) -> list[str]:
    """Loop devices backed by ``image``, read from sysfs (not through the backend)."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with_suffix = backing.read_text().strip()
        if with_suffix.removesuffix(" (deleted)") == str(image):
            found.append(backing.parent.parent.name)
    return found


def mounted_at(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """A btrfs mounted at ``path`` (the shared bind of the dir onto itself under it is
    the mount point, not the storage)."""
    for line in mountinfo.read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(path) and line.split(" - ", 1)[1].split(" ")[0] == "btrfs":
            return True
    return False


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_sandbox_cannot_write_past_its_quota_nor_fill_the_host_disk(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    hog = sandbox_factory(disk_mib=64)
    neighbour = sandbox_factory(disk_mib=64)
    assert backend.storage is not None
    image = backend.storage.image
    os.sync()
    before, image_before = host_free(), image.stat().st_blocks * 512

    err, written = fill(hog, "/workspace/fill", 768)
    assert err in ("EDQUOT", "ENOSPC")
    assert written <= 64 * MiB
    # /tmp is the same volume: the quota covers both
    assert fill(hog, "/tmp/more", 16)[0] in ("EDQUOT", "ENOSPC")
    # written through the storage's loop device into its image on the host
    os.sync()
    # 768 MiB were attempted; the host lost about the quota: the image grew by it (and
    # btrfs metadata), and statvfs agrees (with a margin for what other processes of a
    # shared machine write meanwhile, far below the 768 MiB attempted)
    assert image.stat().st_blocks * 512 - image_before < 64 * MiB + 32 * MiB
    assert before - host_free() < 256 * MiB

    # the other sandbox is not affected by its full neighbour
    assert fill(neighbour, "/workspace/ten", 10) == ("none", 10 * MiB)
    # and the full one recovers by deleting its own files
    code, _, stderr = hog.sh("rm /workspace/fill && echo ok > /workspace/after")
    assert code == 0, stderr


def test_subvolumes_made_inside_a_sandbox_count_against_its_quota(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    sb = sandbox_factory(disk_mib=32)
    # any user may create a btrfs subvolume where it can write; with full qgroups its
    # data would count against no limit (simple quotas make it inherit the group)
    code, out, err = sb.sh("btrfs subvolume create /workspace/inner && mkdir /workspace/inner/d")
    if code != 0:
        # a seccomp profile that refuses the ioctl closes the same hole; anything
        # else (e.g. "not a btrfs filesystem": host dirs) is a failure
        assert "Operation not permitted" in out + err, (out, err)
    target = "/workspace/inner/d" if code == 0 else "/workspace"
    assert fill(sb, f"{target}/fill", 128)[0] in ("EDQUOT", "ENOSPC")

    backend.destroy(sb.id)
    assert backend.storage is not None
    assert not (backend.storage.mount / sb.id).exists()
    assert qgroup_of(sb.id) not in backend.storage.qgroups()


def test_destroy_releases_the_volume_and_its_quota_group(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    sb = sandbox_factory(disk_mib=48)
    storage = backend.storage
    assert storage is not None
    assert fill(sb, "/workspace/data", 8) == ("none", 8 * MiB)
    assert wait_for(lambda: (backend.disk_usage(sb.id) or 0) >= 8 * MiB)
    kinds = {i.kind for i in backend.inventory() if i.sandbox_id == sb.id}
    assert {"volume", "qgroup"} <= kinds
    level, ident = _btrfs.qgroup_name(qgroup_of(sb.id)).split("/")
    limit = storage.sysfs() / "qgroups" / f"{level}_{ident}" / "max_referenced"
    assert int(limit.read_text()) == 48 * MiB

    backend.destroy(sb.id)
    assert not (storage.mount / sb.id).exists()
    assert qgroup_of(sb.id) not in storage.qgroups()
    assert not limit.parent.exists()
    assert [i for i in backend.inventory() if i.sandbox_id == sb.id] == []
    assert backend.disk_usage(sb.id) is None


def test_mountinfo_inside_shows_no_host_path_for_workspace_and_tmp(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    sb = sandbox_factory()
    code, out, _ = sb.sh("cat /proc/self/mountinfo")
    assert code == 0
    mounts = {f[4]: line for line in out.splitlines() for f in [line.split(" ")]}
    # the bind's root is a path inside the storage filesystem, not on the host
    assert mounts["/workspace"].split(" ")[3] == f"/{sb.id}/workspace"
    assert mounts["/tmp"].split(" ")[3] == f"/{sb.id}/tmp"
    for target in ("/workspace", "/tmp"):
        assert str(backend.config.state_dir) not in mounts[target]
        assert " btrfs " in mounts[target] and "nosuid,nodev" in mounts[target]


def test_a_limit_above_the_storage_is_capped_at_its_size(
    backend: LocalBackend, sandbox_factory: Callable[..., Sandbox]
) -> None:
    storage = backend.storage
    assert storage is not None
    sb = sandbox_factory(disk_mib=1 << 30)  # 1 PiB
    level, ident = _btrfs.qgroup_name(qgroup_of(sb.id)).split("/")
    limit = int((storage.sysfs() / "qgroups" / f"{level}_{ident}" / "max_referenced").read_text())
    assert limit == storage.size()


def test_a_leftover_volume_of_the_same_sandbox_id_is_replaced(backend: LocalBackend) -> None:
    storage = backend.storage
    assert storage is not None
    storage.ensure()
    spec = new_spec(disk_mib=40)
    # what a destroy that ran while the storage was unmounted leaves: its volume
    storage.create(spec.sandbox_id, 8 * MiB)
    (storage.mount / spec.sandbox_id / "workspace" / "old").write_text("x")
    try:
        backend.provision(spec)
        assert not (storage.mount / spec.sandbox_id / "workspace" / "old").exists()
        level, ident = _btrfs.qgroup_name(qgroup_of(spec.sandbox_id)).split("/")
        limit = storage.sysfs() / "qgroups" / f"{level}_{ident}" / "max_referenced"
        assert int(limit.read_text()) == 40 * MiB
    finally:
        backend.destroy(spec.sandbox_id)


def test_the_storage_survives_a_backend_restart_and_teardown_leaves_nothing(
    tmp_path: Path,
) -> None:
    first = private_backend(tmp_path, "sr")
    spec = new_spec(disk_mib=64)
    try:
        first.provision(spec)
        storage = first.storage
        assert storage is not None
        (storage.mount / spec.sandbox_id / "workspace" / "kept").write_text("still here")
        image_ino, mount_dev = storage.image.stat().st_ino, os.stat(storage.mount).st_dev
        # a new process of the control plane: a new backend object on the same state
        again = private_backend(tmp_path, "sr")
        other = new_spec()
        again.provision(other)
        assert again.storage is not None
        assert again.storage.image.stat().st_ino == image_ino  # not formatted again
        assert os.stat(again.storage.mount).st_dev == mount_dev  # not mounted twice
        kept = again.storage.mount / spec.sandbox_id / "workspace" / "kept"
        assert kept.read_text() == "still here"
        assert {spec.sandbox_id, other.sandbox_id} <= set(again.storage.volumes())
        assert len(loops_of(storage.image)) == 1
    finally:
        first.teardown_instance()
    assert not mounted_at(storage.mount)
    assert not storage.image.exists()
    # the loop device is released with the last reference to the filesystem
    assert wait_for(lambda: loops_of(storage.image) == [])


def test_release_unmounts_and_the_next_provision_mounts_the_same_storage(
    tmp_path: Path,
) -> None:
    b = private_backend(tmp_path, "rl")
    try:
        spec = new_spec()
        b.provision(spec)
        storage = b.storage
        assert storage is not None
        (storage.mount / spec.sandbox_id / "workspace" / "f").write_text("x")
        b.destroy(spec.sandbox_id)
        b.zygote.stop()
        b.release_storage()  # what `make down` does after destroying every sandbox
        assert not mounted_at(storage.mount)
        assert wait_for(lambda: loops_of(storage.image) == [])
        assert storage.image.exists()
        image_ino = storage.image.stat().st_ino
        b.provision(new_spec())
        assert mounted_at(storage.mount) and storage.image.stat().st_ino == image_ino
    finally:
        b.teardown_instance()


@pytest.mark.parametrize("when", ["before the mount", "after the mount"])
def test_a_mount_namespace_cloned_meanwhile_does_not_keep_the_loop_device(
    tmp_path: Path, when: str
) -> None:
    """Host ``/`` is a private mount: a namespace cloned while the storage is mounted (a
    zygote launcher's) kept a private copy of the btrfs, and after release its loop
    device stayed attached. On the shared bind the unmount reaches the copy."""
    b = private_backend(tmp_path, "ns")
    holder: subprocess.Popen[str] | None = None

    def clone_namespace() -> subprocess.Popen[str]:
        # a process in a new mount namespace copied from this one (propagation as it
        # is, as clone(CLONE_NEWNS) copies it), waiting on its stdin; "in" once it has
        # unshared
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c", "echo in; exec cat"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "in\n"
        return proc

    try:
        storage = b.storage
        assert storage is not None
        if when == "before the mount":
            storage.mount.mkdir(mode=0o711, parents=True, exist_ok=True)
            storage._share_mount_point()  # what ensure() does first
            holder = clone_namespace()
            b.provision(new_spec())
        else:
            b.provision(new_spec())
            holder = clone_namespace()
        theirs = Path(f"/proc/{holder.pid}/mountinfo")
        assert mounted_at(storage.mount, theirs)  # the clone has the storage too
        assert loops_of(storage.image) != []
        for item in b.inventory():
            if item.sandbox_id:
                b.destroy(item.sandbox_id)
        b.zygote.stop()
        b.release_storage()
        assert not mounted_at(storage.mount)
        assert not mounted_at(storage.mount, theirs)  # the unmount reached the clone
        assert holder.poll() is None  # ... which is still there
        assert wait_for(lambda: loops_of(storage.image) == [])
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        b.teardown_instance()
    assert not any(
        line.split(" ")[4] == str(storage.mount)
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )  # teardown took the bind too


def test_inventory_and_reclaim_know_volumes_quota_groups_and_loop_devices(
    tmp_path: Path,
) -> None:
    b = private_backend(tmp_path, "iv")
    try:
        b.provision(new_spec())  # mounts the storage
        storage = b.storage
        assert storage is not None
        # what a provision killed after its volume (and a destroy killed after the
        # state dir's removal) leaves: a volume and its group, no state dir
        storage.create("leaked1", 8 * MiB)
        # a group of nobody (a destroy killed between deleting the volume and it)
        orphan = _btrfs.qgroupid(1, 12345)
        _btrfs.create_qgroup(storage.mount, orphan)
        # a loop device on the image that holds no mount (a killed `mount -o loop`)
        stray = subprocess.run(
            ["losetup", "-f", "--show", str(storage.image)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

        items = b.inventory()
        leaked = {(i.kind, i.name) for i in items if i.sandbox_id == "leaked1"}
        assert leaked == {
            ("volume", str(storage.mount / "leaked1")),
            ("qgroup", f"qgroup:{_btrfs.qgroup_name(qgroup_of('leaked1'))}"),
        }
        unowned = {(i.kind, i.name) for i in items if i.sandbox_id is None}
        assert ("qgroup", f"qgroup:{_btrfs.qgroup_name(orphan)}") in unowned
        assert ("loop", stray) in unowned
        for item in items:
            if item.sandbox_id in ("leaked1", None):
                b.reclaim(item)

        after = b.inventory()
        assert [i for i in after if i.sandbox_id in ("leaked1", None)] == []
        assert not (storage.mount / "leaked1").exists()
        assert orphan not in storage.qgroups()
        assert wait_for(lambda: Path(stray).name not in loops_of(storage.image))
        assert mounted_at(storage.mount)  # the storage itself is never reclaimed
        with pytest.raises(BackendError):
            b.reclaim(InventoryItem("volume", str(tmp_path / "elsewhere"), "x"))
    finally:
        b.teardown_instance()


def test_storage_that_cannot_be_mounted_fails_clearly_and_starts_nothing(
    tmp_path: Path,
) -> None:
    b = private_backend(tmp_path, "nm")
    assert b.storage is not None
    # not a filesystem: what a lost loop device or a corrupt image looks like
    b.storage.image.write_bytes(b"\0" * MiB)
    spec = new_spec()
    try:
        with pytest.raises(BackendError, match="sandbox storage: cannot loop-mount"):
            b.provision(spec)
        assert not (b.sandboxes_dir / spec.sandbox_id).exists()
        assert [i for i in b.inventory() if i.sandbox_id == spec.sandbox_id] == []
    finally:
        b.teardown_instance()
    assert not b.storage.image.exists()


def test_unisolated_sandboxes_have_no_storage(tmp_path: Path) -> None:
    b = LocalBackend(
        LocalBackendConfig(
            state_dir=searchable(tmp_path) / "state",
            instance=f"un{os.getpid()}",
            podagent_dir=PODAGENT,
            isolation="none",
        )
    )
    assert b.storage is None  # documented as unbounded (dev, non-root)
    assert b.disk_usage(uuid.uuid4().hex) is None


# ---- the disk guard (issue 15) -----------------------------------------------------


def test_check_disk_refuses_a_sandbox_the_storage_has_no_room_for(tmp_path):
    """A tiny configured storage (256 MiB): a sandbox whose disk would not fit in what
    is free is refused with DiskExhausted; one that fits is not."""
    config = dataclasses.replace(
        make_config(tmp_path, f"dg{os.getpid()}", "netns"), disk_size_mib=256
    )
    b = LocalBackend(config)
    try:
        spec = new_spec(disk_mib=64)
        b.provision(spec)  # mounts the storage
        b.check_disk(16 << 20, min_free_bytes=0)
        with pytest.raises(DiskExhausted, match="sandbox storage") as info:
            b.check_disk(512 << 20, min_free_bytes=0)
        assert info.value.code == "disk_exhausted"
        b.destroy(spec.sandbox_id)
    finally:
        b.teardown_instance()


def test_check_disk_refuses_below_the_reserve_of_the_state_dir_and_store(tmp_path):
    b = LocalBackend(make_config(tmp_path, f"dr{os.getpid()}", "none"))
    total = shutil.disk_usage(tmp_path).total
    with pytest.raises(DiskExhausted, match=r"state dir.*HEDGEROW_IMAGE_MIN_FREE_MIB"):
        b.check_disk(0, min_free_bytes=total + 1)
    b.check_disk(0, min_free_bytes=1 << 20)  # a small reserve: room
