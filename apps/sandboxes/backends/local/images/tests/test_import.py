"""Importing images without a registry: an OCI layout directory, a docker save tarball."""

from __future__ import annotations

import os
import subprocess

import pytest

from apps.sandboxes.backends.local.images import ImageNotFound, ImageStore, InvalidArchive
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root")

TOP = layer([E("etc", "dir", mode=0o755), E("etc/.wh.passwd"), E("etc/task", data=b"t")])


@pytest.fixture
def layout(tmp_path):
    lay = Layout(tmp_path / "layout")
    desc = lay.image([busybox_layer(), TOP], {"WorkingDir": "/srv"})
    lay.tag("v1", desc)
    return lay, desc


def test_import_oci_layout(layout, tmp_path):
    lay, desc = layout
    store = ImageStore(tmp_path / "store")
    rec = store.import_archive(lay.path, "import/task:1", lease="sb-9")
    assert rec.digest == desc["digest"]  # an OCI layout keeps its digests
    assert rec.reference == "docker.io/import/task:1" and rec.config.working_dir == "/srv"
    top = store.lower_dirs(rec)[0]
    assert (top / "etc/task").read_bytes() == b"t"
    assert os.lstat(top / "etc/passwd").st_rdev == 0  # whiteout in overlay form
    assert store.leased() == {"sb-9": rec.digest}
    assert list(store.staging.iterdir()) == []
    # the same image again: nothing new on disk
    before = sorted(p.name for p in store.blobs.iterdir())
    assert store.import_archive(lay.path, "import/task:1").digest == rec.digest
    assert sorted(p.name for p in store.blobs.iterdir()) == before


def test_import_docker_save_tarball(layout, tmp_path):
    lay, _ = layout
    tarball = tmp_path / "saved.tar"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{lay.path}:v1", f"docker-archive:{tarball}:task:1"],
        check=True,
    )
    store = ImageStore(tmp_path / "store")
    rec = store.import_archive(tarball, "import/task:1")
    assert (store.lower_dirs(rec)[0] / "etc/task").read_bytes() == b"t"
    assert (store.lower_dirs(rec)[1] / "bin/busybox").is_file()
    assert rec.config.working_dir == "/srv"
    assert store.get(rec.digest) == rec


def test_import_missing_or_garbage_is_typed(tmp_path):
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageNotFound):
        store.import_archive(tmp_path / "nope.tar", "import/x:1")
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tarball")
    with pytest.raises(InvalidArchive) as e:
        store.import_archive(garbage, "import/x:1")
    assert e.value.code == "image_archive_invalid" and "manifest.json" in e.value.detail
    assert list(store.images_dir.iterdir()) == [] and list(store.staging.iterdir()) == []
