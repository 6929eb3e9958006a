"""Snapshots on the local backend (issue 16): capture a running image sandbox's
writable root, /workspace and /tmp; restore it into new sandboxes whose trees are
verified against the snapshot's fingerprint; a failed capture leaves nothing.

Real sandboxes on a real image pushed to the registry fixture."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.sandboxes.backends.base import (
    RegistryCredentials,
    SnapshotFailed,
    SnapshotNotFound,
    StateDivergence,
)
from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local.backend import lease_holder, snapshot_holder
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry

from .conftest import Sandbox, needs_root, new_spec

pytestmark = needs_root
APPLETS = ("mkdir", "chmod", "chown", "ln", "dd", "sync", "sha256sum", "mknod", "date", "sleep")


@pytest.fixture(scope="module")
def snap_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    lay = Layout(tmp_path_factory.mktemp("snap-bb") / "layout")
    tools = layer(
        [
            *(E(f"bin/{a}", "symlink", link="busybox") for a in APPLETS),
            E("etc/from-image", data=b"image\n"),
            E("etc/doomed", data=b"deleted in the sandbox\n"),
        ]
    )
    desc = lay.image([busybox_layer(), tools], {"Env": ["PATH=/bin"]})
    lay.tag("v1", desc)
    ref = f"{registry.host}/snap/busybox:v1"
    lay.push("v1", ref, registry.creds)
    return ref


@pytest.fixture
def made(backend: LocalBackend) -> Iterator[Callable[..., Sandbox]]:
    """Sandboxes (of ``snap_image`` or restored from a snapshot), destroyed after."""
    ids: list[str] = []

    def make(image: str, **overrides: Any) -> Sandbox:
        spec = new_spec(
            image=image, registry_credentials=RegistryCredentials(USER, PASSWORD), **overrides
        )
        ids.append(spec.sandbox_id)
        endpoint = backend.provision(spec)
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        return Sandbox(backend, spec, endpoint)

    yield make
    for sid in ids:
        backend.destroy(sid)


@pytest.fixture
def snapshot_ids(backend: LocalBackend) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for sid in ids:
        backend.delete_snapshot(sid)


STATE = (
    "echo hi > /etc/new && rm /etc/doomed && mkdir -p /usr/lib/x && echo y > /usr/lib/x/f"
    " && chmod 4755 /usr/lib/x/f && chown 1000:1000 /etc/new"
    " && echo w > /workspace/w && mkdir /workspace/d && ln -s ../w /workspace/d/link"
    " && echo t > /tmp/t && dd if=/dev/urandom of=/workspace/blob bs=64k count=16 2>/dev/null"
)
READ = (
    "cat /etc/new /usr/lib/x/f /workspace/w /workspace/d/link /tmp/t /etc/from-image;"
    " test -e /etc/doomed || echo doomed-gone; stat -c '%u:%g %a' /etc/new /usr/lib/x/f;"
    " sha256sum /workspace/blob | cut -c1-64"
)


def test_it_restores_a_snapshot_into_independent_children(
    backend: LocalBackend,
    made: Callable[..., Sandbox],
    snap_image: str,
    snapshot_ids: list[str],
) -> None:
    parent = made(snap_image)
    code, _, err = parent.sh(STATE)
    assert code == 0, err
    before = parent.sh(READ)
    assert before[0] == 0 and "doomed-gone" in before[1], before

    snap_id = uuid.uuid4().hex
    snapshot_ids.append(snap_id)
    info = backend.snapshot(parent.id, snap_id)
    assert info.snapshot_id == snap_id and info.sandbox_id == parent.id
    assert info.image == snap_image and info.image_digest == parent.endpoint.image_digest
    assert info.fingerprint.startswith("sha256:") and info.size_bytes >= 16 * 65536
    assert snap_id in backend.snapshots()
    # the snapshot keeps its image in the cache: a lease of its own
    lease = (
        backend.config.image_store / "leases" / snapshot_holder(backend.config.instance, snap_id)
    )
    assert json.loads(lease.read_text()) == {"digest": info.image_digest}
    # the parent runs on after the capture (thawed) and its later writes are not in it
    assert parent.sh("echo after > /workspace/after && cat /workspace/after")[:2] == (0, "after\n")

    children = [made(snap_image, snapshot_id=snap_id) for _ in range(3)]
    for child in children:
        assert child.sh(READ) == before
        assert child.endpoint.image_digest == info.image_digest
        assert child.sh("test -e /workspace/after || echo absent")[1] == "absent\n"
        lease_of = lease_holder(backend.config.instance, child.id)
        assert (backend.config.image_store / "leases" / lease_of).exists()
    # the children's files are their own: owners moved to each one's host id range
    uid_bases = {
        json.loads((backend._dir(c.id) / "meta.json").read_text())["uid_base"] for c in children
    }
    assert len(uid_bases) == 3
    for child in children:
        base = json.loads((backend._dir(child.id) / "meta.json").read_text())["uid_base"]
        st = os.stat(backend.storage.mount / child.id / "root/upper/etc/new")  # type: ignore[union-attr]
        assert (st.st_uid, st.st_gid) == (base + 1000, base + 1000)

    # a write in one child reaches neither the parent, nor a sibling, nor the snapshot
    assert children[0].sh("echo mine > /workspace/w && echo x > /etc/new")[0] == 0
    assert children[1].sh("cat /workspace/w /etc/new")[1] == "w\nhi\n"
    assert parent.sh("cat /workspace/w /etc/new")[1] == "w\nhi\n"
    later = made(snap_image, snapshot_id=snap_id)
    assert later.sh(READ) == before

    backend.delete_snapshot(snap_id)
    assert snap_id not in backend.snapshots() and not lease.exists()
    assert not (backend.storage.snapshots_dir / snap_id).exists()  # type: ignore[union-attr]
    # the children keep their state
    assert children[2].sh(READ) == before
    with pytest.raises(SnapshotNotFound):
        backend.provision(new_spec(image=snap_image, snapshot_id=snap_id))


def test_it_reports_a_tampered_snapshot_with_its_diff(
    backend: LocalBackend,
    made: Callable[..., Sandbox],
    snap_image: str,
    snapshot_ids: list[str],
) -> None:
    parent = made(snap_image)
    assert parent.sh("echo original > /workspace/state && echo keep > /workspace/same")[0] == 0
    snap_id = uuid.uuid4().hex
    snapshot_ids.append(snap_id)
    backend.snapshot(parent.id, snap_id)
    path = backend.storage.snapshots_dir / snap_id  # type: ignore[union-attr]
    subprocess.run(["btrfs", "property", "set", "-f", str(path), "ro", "false"], check=True)
    (path / "workspace" / "state").write_text("tampered\n")
    subprocess.run(["btrfs", "property", "set", "-f", str(path), "ro", "true"], check=True)

    spec = new_spec(image=snap_image, snapshot_id=snap_id)
    with pytest.raises(StateDivergence) as caught:
        backend.provision(spec)
    (entry,) = caught.value.diff
    assert entry["path"] == "workspace/state"
    assert entry["expected"].split(" ")[3] == "9" and entry["actual"].split(" ")[3] == "9"
    assert entry["expected"] != entry["actual"]
    # nothing of the child is left
    assert not (backend.storage.mount / spec.sandbox_id).exists()  # type: ignore[union-attr]
    assert backend.endpoint(spec.sandbox_id) is None


def test_a_failed_capture_leaves_nothing(
    backend: LocalBackend, made: Callable[..., Sandbox], snap_image: str
) -> None:
    parent = made(snap_image)
    snap_id = uuid.uuid4().hex

    def die(point: str) -> None:
        if point == "snapshot_captured":
            raise OSError("killed mid-capture")

    backend.fault_hook = die
    try:
        with pytest.raises(SnapshotFailed, match="killed mid-capture"):
            backend.snapshot(parent.id, snap_id)
    finally:
        backend.fault_hook = None
    assert snap_id not in backend.snapshots()
    assert not os.path.lexists(backend.storage.snapshots_dir / snap_id)  # type: ignore[union-attr]
    holder = snapshot_holder(backend.config.instance, snap_id)
    assert not (backend.config.image_store / "leases" / holder).exists()
    # thawed: the sandbox answers
    assert parent.sh("echo alive")[:2] == (0, "alive\n")
    freezer = json.loads((backend._dir(parent.id) / "meta.json").read_text())["cgroups"]["freezer"]
    assert (Path(freezer) / "freezer.state").read_text().strip() == "THAWED"

    # a sandbox that is not running cannot be captured
    backend.destroy(parent.id)
    with pytest.raises(SnapshotFailed) as caught:
        backend.snapshot(parent.id, uuid.uuid4().hex)
    assert caught.value.code == "sandbox_not_running"


def test_a_host_sandbox_snapshot_restores_workspace_and_tmp(
    backend: LocalBackend, made: Callable[..., Sandbox], snapshot_ids: list[str]
) -> None:
    parent = made("host")
    assert parent.sh("echo w > /workspace/w && echo t > /tmp/t")[0] == 0
    snap_id = uuid.uuid4().hex
    snapshot_ids.append(snap_id)
    info = backend.snapshot(parent.id, snap_id)
    assert info.image == "host" and info.image_digest == ""
    child = made("host", snapshot_id=snap_id)
    assert child.sh("cat /workspace/w /tmp/t")[1] == "w\nt\n"
