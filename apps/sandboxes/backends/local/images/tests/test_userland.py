"""A real distribution userland through the whole store: Debian minbase with python3,
pytest and git (built once per machine with mmdebstrap, ocibuild.userland_layer),
pushed to the loopback registry with a /testbed layer on top, pulled, mounted as an
idmapped overlay, and used as a SWE-style task would: a failing test in /testbed,
a fix applied as root of the sandbox's user namespace, pytest and git in the image."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.sandboxes.backends.local.images import (
    Credentials,
    ImageRecord,
    ImageStore,
    RegistryPolicy,
)
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, layer, userland_layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry
from apps.sandboxes.backends.local.images.tests.rootfs import Root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

TEST = b"from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n"
BUGGY = b"def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def userland(
    registry: Registry, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ImageStore, ImageRecord]:
    path, diff_id = userland_layer()
    testbed = layer(
        [
            E("testbed", "dir", mode=0o755),
            E("testbed/calc.py", data=BUGGY),
            E("testbed/test_calc.py", data=TEST),
        ]
    )
    tmp = tmp_path_factory.mktemp("userland")
    lay = Layout(tmp / "layout")
    config = {
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "WorkingDir": "/testbed",
        "Cmd": ["/bin/bash"],
    }
    lay.tag("v1", lay.image([(path.read_bytes(), diff_id), testbed], config))
    lay.push("v1", f"{registry.host}/t/userland:v1", registry.creds)
    store = ImageStore(tmp / "store", policy=RegistryPolicy.of(insecure=[registry.host]))
    rec = store.pull(f"{registry.host}/t/userland:v1", credentials=Credentials(USER, PASSWORD))
    return store, rec


@pytest.fixture
def root(userland: tuple[ImageStore, ImageRecord], tmp_path: Path) -> Iterator[Root]:
    store, rec = userland
    r = Root(tmp_path / "root", 2_000_200_000, store.lower_dirs(rec), devices=True)
    try:
        yield r
    finally:
        r.close()


def test_swe_style_task_in_a_distribution_image(userland, root):
    store, rec = userland
    assert rec.config.working_dir == "/testbed"
    env = "export " + " ".join(rec.config.env) + "; cd /testbed; "

    failing = root.run(env + "python3 -m pytest -q -p no:cacheprovider")
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "1 failed" in failing.stdout

    out = root.sh(
        env + "git init -q . && git add -A && "
        "git -c user.email=a@b -c user.name=a commit -qm task && "
        "sed -i 's/a - b/a + b/' calc.py && git diff --stat && "
        "python3 -m pytest -q -p no:cacheprovider && "
        "pip_target=$(python3 -c 'import sys; print(sys.prefix)') && echo prefix=$pip_target && "
        "stat -c '%u %n' /usr/bin/python3.11 /etc/passwd && id -un"
    )
    assert "1 file changed" in out and "1 passed" in out
    assert "prefix=/usr" in out
    assert "0 /usr/bin/python3.11" in out and "0 /etc/passwd" in out
    assert out.rstrip().endswith("root")
    # the fix and the repository live in this root's upper dir, not in the image
    assert (root.upper / "testbed/calc.py").read_bytes() == BUGGY.replace(b"a - b", b"a + b")
    assert (root.upper / "testbed/.git").is_dir()
    assert (store.lower_dirs(rec)[0] / "testbed/calc.py").read_bytes() == BUGGY
