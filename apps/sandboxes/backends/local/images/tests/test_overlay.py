"""Overlay spike: a sandbox root made of idmapped image layers + a private upper dir.

Proves on this kernel that layers unpacked once with their real owners (uid 0) are
seen as root's inside a user namespace mapping 0 to an unprivileged host range, that
the image's own busybox running as that root writes anywhere (copy-up into the upper
dir, owned by the range), that the layers stay untouched, and that two roots over one
layer never see each other's writes. Whiteouts and opaque dirs written by the
unpacker are honoured by the kernel's overlayfs.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.sandboxes.backends.local.images import (
    Credentials,
    ImageRecord,
    ImageStore,
    RegistryPolicy,
)
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry
from apps.sandboxes.backends.local.images.tests.rootfs import Root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

BASES = (2_000_000_000, 2_000_100_000)  # far above any login or sandbox uid on the host


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            out[str(p.relative_to(root))] = (st.st_uid, st.st_mode, st.st_mtime_ns, data)
    return out


@pytest.fixture(scope="module")
def image(
    registry: Registry, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ImageStore, ImageRecord]:
    tmp = tmp_path_factory.mktemp("overlay-image")
    base = layer(
        [
            E("etc", "dir", mode=0o755),
            E("etc/owned-by-root", data=b"layer\n", mode=0o644),
            E("etc/gone", data=b"deleted by the next layer"),
            E("home", "dir", mode=0o755),
            E("home/user", "dir", mode=0o750, uid=1000, gid=1000),
            E("home/user/notes", data=b"n", mode=0o600, uid=1000, gid=1000),
            E("opt", "dir", mode=0o755),
            E("opt/app", "dir", mode=0o755),
            E("opt/app/old", data=b"hidden by the opaque dir"),
        ]
    )
    top = layer(
        [
            E("etc/.wh.gone"),
            E("opt/app", "dir", mode=0o755),
            E("opt/app/.wh..wh..opq"),
            E("opt/app/new", data=b"new"),
        ]
    )
    lay = Layout(tmp / "layout")
    lay.tag("v1", lay.image([busybox_layer(), base, top]))
    lay.push("v1", f"{registry.host}/t/overlay:v1", registry.creds)
    store = ImageStore(tmp / "store", policy=RegistryPolicy.of(insecure=[registry.host]))
    rec = store.pull(f"{registry.host}/t/overlay:v1", credentials=Credentials(USER, PASSWORD))
    return store, rec


@pytest.fixture
def roots(image: tuple[ImageStore, ImageRecord], tmp_path: Path) -> Iterator[list[Root]]:
    store, rec = image
    made = [Root(tmp_path / f"r{i}", base, store.lower_dirs(rec)) for i, base in enumerate(BASES)]
    try:
        yield made
    finally:
        for r in made:
            r.close()


def test_root_inside_sees_layer_owners_and_writes_by_copy_up(image, roots):
    store, rec = image
    layers_before = {str(p): _snapshot(p) for p in store.lower_dirs(rec)}
    root = roots[0]

    out = root.sh(
        "id -u; stat -c '%u:%g %a %n' /etc/owned-by-root /home/user /home/user/notes /;"
        "echo written >> /etc/owned-by-root; mkdir /srv/testbed -p; echo t > /srv/testbed/f;"
        "touch /home/user/notes; rm /bin/ls; cat /etc/owned-by-root"
    )
    assert out.splitlines() == [
        "0",
        "0:0 644 /etc/owned-by-root",
        "1000:1000 750 /home/user",
        "1000:1000 600 /home/user/notes",
        f"0:0 {oct(stat.S_IMODE(root.upper.stat().st_mode))[2:]} /",
        "layer",
        "written",
    ]
    # the host sees the sandbox's files in its unprivileged range, never as root
    assert os.stat(root.target / "etc/owned-by-root").st_uid == root.base
    assert os.stat(root.target / "home/user").st_uid == root.base + 1000
    # what was written is in the upper dir, owned by the range
    copied = root.upper / "etc/owned-by-root"
    assert copied.read_bytes() == b"layer\nwritten\n" and copied.stat().st_uid == root.base
    assert (root.upper / "srv/testbed/f").stat().st_uid == root.base
    assert (root.upper / "home/user/notes").stat().st_uid == root.base + 1000
    removed = os.lstat(root.upper / "bin/ls")  # a whiteout made by the kernel
    assert stat.S_ISCHR(removed.st_mode) and removed.st_rdev == 0
    # the shared layers are untouched
    assert {str(p): _snapshot(p) for p in store.lower_dirs(rec)} == layers_before


def test_two_roots_over_one_image_are_isolated(roots):
    a, b = roots
    a.sh("echo from-a > /etc/owned-by-root; touch /only-a; rm /etc/passwd")
    out = b.sh("cat /etc/owned-by-root; ls /only-a 2>&1 || true; ls /etc/passwd")
    assert out.splitlines()[0] == "layer"
    assert "No such file" in out.splitlines()[1]
    assert out.splitlines()[2] == "/etc/passwd"
    assert os.listdir(b.upper) == []  # b wrote nothing, a's writes are a's alone
    assert a.sh("cat /etc/owned-by-root; ls /etc/passwd 2>&1 || true").splitlines() == [
        "from-a",
        "ls: /etc/passwd: No such file or directory",
    ]


def test_unpacked_whiteouts_and_opaque_dirs_work_in_overlayfs(roots):
    out = roots[0].sh("ls /etc; echo --; ls /opt/app")
    etc, app = out.split("--\n")
    assert "gone" not in etc.split() and "owned-by-root" in etc.split()
    assert app.split() == ["new"]
