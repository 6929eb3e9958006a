"""The config's User resolved against the image's own passwd/group, through layers."""

from __future__ import annotations

import os

import pytest

from apps.sandboxes.backends.local.images import Credentials, ImageStore, RegistryPolicy
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER
from apps.sandboxes.backends.local.images.user import ImageUserUnknown, read_merged, resolve_user

# unpacking keeps owners and makes whiteout device nodes: root only, like the
# local backend's own tests
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root")


@pytest.fixture(scope="module")
def lowers(registry, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user")
    # busybox's passwd has user:1000:1000; the top layer replaces it, adds a group
    # file, and deletes /etc/shadow-like leftovers through a whiteout
    top = layer(
        [
            E("etc", "dir", mode=0o755),
            E(
                "etc/passwd",
                data=b"root:x:0:0::/root:/bin/sh\ndev:x:1500:1600::/home/dev:/bin/sh\n",
            ),
            E("etc/group", data=b"root:x:0:\ndev:x:1600:\nstaff:x:50:\n"),
        ]
    )
    lay = Layout(tmp / "layout")
    lay.tag("v1", lay.image([busybox_layer(), top], {"User": "dev"}))
    lay.push("v1", f"{registry.host}/t/users:v1", registry.creds)
    store = ImageStore(tmp / "store", policy=RegistryPolicy.of(insecure=[registry.host]))
    rec = store.pull(f"{registry.host}/t/users:v1", credentials=Credentials(USER, PASSWORD))
    assert rec.config.user == "dev"
    return store.lower_dirs(rec)


@pytest.mark.parametrize(
    "user,ids",
    [
        ("", (0, 0)),
        ("dev", (1500, 1600)),
        ("dev:staff", (1500, 50)),
        ("1500", (1500, 1600)),
        ("4242", (4242, 0)),
        ("4242:77", (4242, 77)),
        ("root:dev", (0, 1600)),
    ],
)
def test_user_resolved_in_the_merged_layers(lowers, user, ids):
    assert resolve_user("img", lowers, user) == ids


def test_merged_view_honours_whiteouts_and_opaque_dirs(lowers):
    assert (read_merged(lowers, "etc/passwd") or b"").startswith(b"root:x:0:0::/root")
    assert read_merged(lowers, "bin/busybox") is not None  # from the bottom layer
    assert read_merged(lowers, "etc/motd") is None
    assert read_merged(lowers, "opt/d/x") is None
    assert read_merged(lowers, "bin/sh") is None  # a symlink is not followed


@pytest.mark.parametrize("user", ["user", "nobody", "dev:wheel"])
def test_unknown_names_are_errors_not_root(lowers, user):
    # "user" exists only in the lower busybox layer's passwd, which the top one replaced
    with pytest.raises(ImageUserUnknown) as e:
        resolve_user("img", lowers, user)
    assert e.value.code == "image_user_unknown"
