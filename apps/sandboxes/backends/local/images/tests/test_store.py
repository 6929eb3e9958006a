"""The image store against a real registry (Debian's docker-registry on loopback), with
images these tests build and push themselves."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from apps.sandboxes.backends.local.images import (
    Credentials,
    DigestMismatch,
    DiskExhausted,
    ImageNotFound,
    ImageStore,
    LayerRefused,
    RegistryPolicy,
    RegistryUnauthorized,
    RegistryUnreachable,
    UnsupportedPlatform,
)
from apps.sandboxes.backends.local.images.errors import PUBLIC_MESSAGES
from apps.sandboxes.backends.local.images.skopeo import Skopeo
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry

CREDS = Credentials(USER, PASSWORD)
BB = busybox_layer()

# unpacking keeps owners and makes whiteout device nodes: root only, like the
# local backend's own tests
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root")


def push(registry: Registry, tmp: Path, repo: str, layers, config=None, tag="v1") -> dict[str, Any]:
    lay = Layout(tmp / f"layout-{repo.replace('/', '-')}-{tag}")
    desc = lay.image(layers, config)
    lay.tag(tag, desc)
    lay.push(tag, f"{registry.host}/{repo}:{tag}", registry.creds)
    return desc


@pytest.fixture
def store(tmp_path: Path, listed_policy: RegistryPolicy) -> ImageStore:
    return ImageStore(tmp_path / "store", policy=listed_policy)


def test_pull_busybox_stores_blobs_by_digest_and_unpacks_layers(registry, store, tmp_path):
    desc = push(registry, tmp_path, "t/busybox", [BB], {"Cmd": ["/bin/sh"]})
    rec = store.pull(f"{registry.host}/t/busybox:v1", credentials=CREDS)

    assert rec.digest == desc["digest"]
    assert rec.reference == f"{registry.host}/t/busybox:v1"
    assert rec.config.cmd == ["/bin/sh"]
    assert len(rec.layers) == 1 and rec.layers[0].diff_id == BB[1]
    # every blob is stored under its own digest, read-only
    for digest in [rec.digest, rec.layers[0].digest]:
        blob = store.blobs / digest.split(":")[1]
        assert blob.is_file() and stat.S_IMODE(blob.stat().st_mode) == 0o444
    fs = store.lower_dirs(rec)[0]
    busybox = fs / "bin/busybox"
    assert busybox.read_bytes() == Path("/bin/busybox").read_bytes()
    assert stat.S_IMODE(busybox.stat().st_mode) == 0o755
    assert os.readlink(fs / "bin/sh") == "busybox"
    assert stat.S_IMODE((fs / "tmp").stat().st_mode) == 0o1777
    # nothing left behind by the pull
    assert list(store.staging.iterdir()) == []
    assert store.get(rec.digest) == rec


def test_layer_shared_by_two_images_is_fetched_and_stored_once(registry, store, tmp_path):
    extra_a = layer([E("a.txt", data=b"a")])
    extra_b = layer([E("b.txt", data=b"b")])
    push(registry, tmp_path, "t/share-a", [BB, extra_a])
    push(registry, tmp_path, "t/share-b", [BB, extra_b])
    before = registry.blob_gets("t/share-a") + registry.blob_gets("t/share-b")

    a = store.pull(f"{registry.host}/t/share-a:v1", credentials=CREDS)
    b = store.pull(f"{registry.host}/t/share-b:v1", credentials=CREDS)

    assert a.layers[0].digest == b.layers[0].digest
    assert store.lower_dirs(a)[-1] == store.lower_dirs(b)[-1]
    assert len(list(store.layers_dir.iterdir())) == 3
    # a: config + 2 layers; b: config + its own layer (the shared one was in the store)
    fetched = registry.blob_gets("t/share-a") + registry.blob_gets("t/share-b") - before
    assert fetched == 5


def test_whiteout_and_opaque_dir_become_overlayfs_form(registry, store, tmp_path):
    base = layer(
        [
            E("etc", "dir", mode=0o755),
            E("etc/keep", data=b"k"),
            E("etc/gone", data=b"g"),
            E("opt", "dir", mode=0o755),
            E("opt/dir", "dir", mode=0o755),
            E("opt/dir/old", data=b"o"),
        ]
    )
    top = layer(
        [
            E("etc/.wh.gone"),
            E("opt/dir", "dir", mode=0o755),
            E("opt/dir/.wh..wh..opq"),
            E("opt/dir/new", data=b"n"),
        ]
    )
    push(registry, tmp_path, "t/whiteout", [BB, base, top])
    rec = store.pull(f"{registry.host}/t/whiteout:v1", credentials=CREDS)

    upper = store.lower_dirs(rec)[0]
    gone = os.lstat(upper / "etc/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == os.makedev(0, 0)
    assert not (upper / "etc/.wh.gone").exists()
    assert os.getxattr(upper / "opt/dir", "trusted.overlay.opaque") == b"y"
    assert not (upper / "opt/dir/.wh..wh..opq").exists()
    assert (upper / "opt/dir/new").read_bytes() == b"n"
    # the lower layer is untouched: the whiteout is the overlay's business
    assert (store.lower_dirs(rec)[1] / "etc/gone").read_bytes() == b"g"


def test_config_user_env_workdir_recorded(registry, store, tmp_path):
    cfg = {
        "User": "1000:1000",
        "Env": ["PATH=/bin", "GREETING=hello world"],
        "WorkingDir": "/home/user",
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["id"],
    }
    push(registry, tmp_path, "t/user", [BB], cfg)
    rec = store.pull(f"{registry.host}/t/user:v1", credentials=CREDS)
    assert rec.config.user == "1000:1000"
    assert rec.config.env == ["PATH=/bin", "GREETING=hello world"]
    assert rec.config.working_dir == "/home/user"
    assert rec.config.entrypoint == ["/bin/sh", "-c"] and rec.config.cmd == ["id"]


def test_ownership_modes_xattrs_hardlinks_kept(registry, store, tmp_path):
    lay = layer(
        [
            E("srv", "dir", mode=0o750, uid=1000, gid=1001),
            E("srv/tool", data=b"#!/bin/sh\n", mode=0o4755, uid=0, gid=0),
            E("srv/data", data=b"d", mode=0o600, uid=1000, gid=1001, xattrs={"user.tag": "v"}),
            E("srv/alias", "hardlink", link="srv/data"),
            E("srv/link", "symlink", link="/etc/passwd", uid=1000, gid=1001),
            E("srv/pipe", "fifo", mode=0o640),
        ]
    )
    push(registry, tmp_path, "t/owners", [BB, lay])
    fs = store.lower_dirs(store.pull(f"{registry.host}/t/owners:v1", credentials=CREDS))[0]

    srv = (fs / "srv").stat()
    assert (srv.st_uid, srv.st_gid, stat.S_IMODE(srv.st_mode)) == (1000, 1001, 0o750)
    assert stat.S_IMODE((fs / "srv/tool").stat().st_mode) == 0o4755  # setuid survives chown
    data = (fs / "srv/data").stat()
    assert (data.st_uid, data.st_gid, stat.S_IMODE(data.st_mode)) == (1000, 1001, 0o600)
    assert os.getxattr(fs / "srv/data", "user.tag") == b"v"
    assert (fs / "srv/alias").stat().st_ino == data.st_ino
    link = os.lstat(fs / "srv/link")
    assert os.readlink(fs / "srv/link") == "/etc/passwd" and link.st_uid == 1000
    assert stat.S_ISFIFO((fs / "srv/pipe").stat().st_mode)


@pytest.mark.parametrize(
    "bad,why",
    [
        (E("dev/sda", "char"), "device node"),
        (E("../escape", data=b"x"), "leaves the layer"),
        (E("etc/x", data=b"x", xattrs={"trusted.overlay.redirect": "/etc"}), "overlay xattr"),
        (E("srv/x", "hardlink", link="../../etc/passwd"), "leaves the layer"),
    ],
)
def test_dangerous_layers_refused_and_nothing_kept(registry, store, tmp_path, bad, why):
    repo = f"t/bad-{abs(hash(why)) % 10**6}"
    push(registry, tmp_path, repo, [BB, layer([E("srv", "dir", mode=0o755), bad])])
    with pytest.raises(LayerRefused, match=why):
        store.pull(f"{registry.host}/{repo}:v1", credentials=CREDS)
    # the busybox layer was unpacked; the refused one left no directory behind
    assert len(list(store.layers_dir.iterdir())) == 1
    assert list(store.images_dir.iterdir()) == []
    assert [p for p in store.tmp.iterdir() if p.name.startswith("layer-")] == []
    assert list(store.staging.iterdir()) == []
    # what the refused pull stored is used by no image: the next collect sweeps it
    assert store.collect(cap_bytes=1 << 40) == []
    assert list(store.layers_dir.iterdir()) == [] and list(store.blobs.iterdir()) == []


def test_path_through_a_symlink_of_the_layer_refused(registry, store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    bad = layer([E("evil", "symlink", link=str(outside)), E("evil/planted", data=b"x")])
    push(registry, tmp_path, "t/symlink-escape", [bad])
    with pytest.raises(LayerRefused, match="symlink"):
        store.pull(f"{registry.host}/t/symlink-escape:v1", credentials=CREDS)
    assert list(outside.iterdir()) == []


def test_auth_required_and_wrong_password_refused(registry, store, tmp_path):
    push(registry, tmp_path, "t/private", [BB])
    ref = f"{registry.host}/t/private:v1"
    with pytest.raises(RegistryUnauthorized) as e:
        store.pull(ref)
    assert e.value.code == "registry_unauthorized"
    # skopeo's words are the operator's (detail), the tenant's message is fixed
    assert "authentication required" in e.value.detail
    assert e.value.message == PUBLIC_MESSAGES["registry_unauthorized"]
    with pytest.raises(RegistryUnauthorized):
        store.pull(ref, credentials=Credentials(USER, "wrong"))
    assert list(store.images_dir.iterdir()) == []
    assert store.pull(ref, credentials=CREDS).digest


def test_cached_image_still_needs_the_callers_credentials(registry, store, tmp_path):
    push(registry, tmp_path, "t/cached", [BB])
    ref = f"{registry.host}/t/cached:v1"
    rec = store.pull(ref, credentials=CREDS)
    with pytest.raises(RegistryUnauthorized):
        store.pull(f"{registry.host}/t/cached@{rec.digest}", credentials=Credentials(USER, "x"))


def test_anonymous_registry_pull(open_registry, store, tmp_path):
    push(open_registry, tmp_path, "t/public", [BB])
    rec = store.pull(f"{open_registry.host}/t/public:v1")
    assert store.lower_dirs(rec)[0].joinpath("bin/busybox").is_file()


def test_unknown_image_and_unreachable_registry_typed(registry, store):
    with pytest.raises(ImageNotFound) as e:
        store.pull(f"{registry.host}/t/no-such-image:v1", credentials=CREDS)
    assert e.value.code == "image_not_found" and "manifest unknown" in e.value.detail
    # a loopback port nobody listens on (listed: the egress policy lets it be asked);
    # no retries (skopeo backs off between them)
    listed = RegistryPolicy.of(insecure=["127.0.0.1:1"])
    quick = ImageStore(store.root, policy=listed, skopeo=Skopeo(retry_times=0))
    with pytest.raises(RegistryUnreachable) as e2:
        quick.pull("127.0.0.1:1/t/x:v1")
    assert e2.value.code == "registry_unreachable" and "connection refused" in e2.value.detail
    assert e2.value.message == PUBLIC_MESSAGES["registry_unreachable"]


def test_tampered_blob_refused_and_not_stored(registry, store, tmp_path):
    tampered = layer([E("payload", data=b"the real content")])
    push(registry, tmp_path, "t/tampered", [BB, tampered])
    data = registry.blob_file("sha256:" + hashlib.sha256(tampered[0]).hexdigest())
    data.write_bytes(layer([E("payload", data=b"evil")])[0])
    with pytest.raises(DigestMismatch) as e:
        store.pull(f"{registry.host}/t/tampered:v1", credentials=CREDS)
    assert e.value.code == "image_digest_mismatch"
    stored = {p.name for p in store.blobs.iterdir()}
    assert hashlib.sha256(tampered[0]).hexdigest() not in stored
    assert list(store.images_dir.iterdir()) == []


def test_wrong_diff_id_refused(registry, store, tmp_path):
    lay = Layout(tmp_path / "diffid")
    blob, _ = layer([E("f", data=b"x")])
    desc = lay.image([(blob, "sha256:" + "0" * 64)])
    lay.tag("v1", desc)
    lay.push("v1", f"{registry.host}/t/diffid:v1", registry.creds)
    with pytest.raises(DigestMismatch, match="config says"):
        store.pull(f"{registry.host}/t/diffid:v1", credentials=CREDS)
    assert list(store.layers_dir.iterdir()) == []


def test_multi_platform_index_resolved_for_this_machine(registry, store, tmp_path):
    lay = Layout(tmp_path / "multi")
    amd = lay.image([BB, layer([E("arch", data=b"amd64")])], arch="amd64")
    arm = lay.image([layer([E("arch", data=b"arm64")])], arch="arm64")
    idx = lay.index([arm, amd])
    lay.tag("v1", idx)
    lay.push("v1", f"{registry.host}/t/multi:v1", registry.creds, all_=True)
    only_arm = lay.index([arm])
    lay.tag("arm", only_arm)
    lay.push("arm", f"{registry.host}/t/multi:arm", registry.creds, all_=True)

    rec = store.pull(f"{registry.host}/t/multi:v1", credentials=CREDS)
    assert rec.digest == amd["digest"] and rec.index_digest == idx["digest"]
    assert (store.lower_dirs(rec)[0] / "arch").read_bytes() == b"amd64"
    with pytest.raises(UnsupportedPlatform, match="linux/arm64"):
        store.pull(f"{registry.host}/t/multi:arm", credentials=CREDS)


def test_twenty_concurrent_pulls_download_once(registry, store, tmp_path):
    layers = [BB, layer([E("one", data=os.urandom(200_000))])]
    push(registry, tmp_path, "t/flight", layers)
    results: list[object] = []

    def pull() -> None:
        try:
            results.append(store.pull(f"{registry.host}/t/flight:v1", credentials=CREDS))
        except Exception as e:
            results.append(e)

    threads = [threading.Thread(target=pull) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 20
    assert [r for r in results if isinstance(r, Exception)] == []
    assert len({r.digest for r in results}) == 1  # type: ignore[attr-defined]
    assert registry.blob_gets("t/flight") == 3  # config + 2 layers, each once


def test_pull_resumes_after_a_crash_without_fetching_layers_again(registry, store, tmp_path):
    layers = [BB, layer([E("r", data=b"r")])]
    push(registry, tmp_path, "t/resume", layers)
    ref = f"{registry.host}/t/resume:v1"
    digests = ["sha256:" + hashlib.sha256(blob).hexdigest() for blob, _ in layers]

    def crash(stage: str) -> None:
        raise KeyboardInterrupt(stage)  # as a killed worker: not an ImageError

    store.fault_hook = crash
    with pytest.raises(KeyboardInterrupt):
        store.pull(ref, credentials=CREDS)
    assert list(store.images_dir.iterdir()) == []
    assert [registry.blob_gets("t/resume", d) for d in digests] == [1, 1]

    resumed = ImageStore(store.root, policy=store.policy)  # a new process after the crash
    rec = resumed.pull(ref, credentials=CREDS)
    # the layers in the crashed pull's staging layout are verified and kept, not
    # fetched again (skopeo re-reads the small config blob of every copy)
    assert [registry.blob_gets("t/resume", d) for d in digests] == [1, 1]
    assert (resumed.lower_dirs(rec)[0] / "r").read_bytes() == b"r"


def test_disk_guard_refuses_pull_before_writing(registry, tmp_path, listed_policy):
    push(registry, tmp_path, "t/big", [BB])
    store = ImageStore(tmp_path / "store", policy=listed_policy, min_free_bytes=1 << 62)
    with pytest.raises(DiskExhausted) as e:
        store.pull(f"{registry.host}/t/big:v1", credentials=CREDS)
    assert e.value.code == "disk_exhausted"
    assert list(store.blobs.iterdir()) == [] and list(store.layers_dir.iterdir()) == []


def test_record_and_refs_survive_as_json(registry, store, tmp_path):
    push(registry, tmp_path, "t/record", [BB])
    rec = store.pull(f"{registry.host}/t/record:v1", credentials=CREDS)
    assert store.records() == [rec]
    refs = [json.loads(p.read_text()) for p in store.refs_dir.iterdir()]
    assert refs == [{"reference": rec.reference, "digest": rec.digest}]


def test_progress_reports_layers_and_bytes(registry, store, tmp_path):
    payload = layer([E("big", data=os.urandom(3_000_000))])
    push(registry, tmp_path, "t/progress", [BB, payload])
    events: list[dict[str, Any]] = []
    rec = store.pull(f"{registry.host}/t/progress:v1", credentials=CREDS, progress=events.append)
    phases = [e["phase"] for e in events]
    assert phases[0] == "resolved" and phases[-1] == "done"
    fetched = next(e for e in events if e["phase"] == "fetched")
    assert fetched["bytes"] == fetched["total"] == rec.size and fetched["layers"] == 2
    assert [e["layer"] for e in events if e["phase"] == "unpacked"] == [1, 2]
    # bytes never go backwards while fetching
    counts = [e["bytes"] for e in events if e["phase"] == "fetching"]
    assert counts == sorted(counts)


def test_collection_removes_lru_images_but_never_a_leased_one(registry, store, tmp_path):
    for name in ("old-leased", "old", "new"):
        push(registry, tmp_path, f"t/gc-{name}", [BB, layer([E(name, data=os.urandom(50_000))])])
    leased = store.pull(f"{registry.host}/t/gc-old-leased:v1", credentials=CREDS, lease="sb-1")
    old = store.pull(f"{registry.host}/t/gc-old:v1", credentials=CREDS)
    new = store.pull(f"{registry.host}/t/gc-new:v1", credentials=CREDS)
    assert store.leased() == {"sb-1": leased.digest}

    # room for two images' worth: the oldest unleased one goes, nothing else
    cap = store.usage() - 1
    assert store.collect(cap) == [old.digest]
    assert store.get(old.digest) is None
    assert not store.layer_path(old.layers[1].digest).exists()
    assert not (store.blobs / old.layers[1].digest.split(":")[1]).exists()
    # the busybox layer is shared with the images that stay: kept
    assert store.layer_path(old.layers[0].digest).is_dir()
    for rec in (leased, new):
        assert all(p.is_dir() for p in store.lower_dirs(rec))

    # even a cap of 0 keeps the leased image and what it uses, and in_use ones
    assert store.collect(0, in_use=frozenset({new.digest})) == []
    assert store.collect(0) == [new.digest]
    assert [r.digest for r in store.records()] == [leased.digest]
    assert all(p.is_dir() for p in store.lower_dirs(leased))
    store.release("sb-1")
    assert store.collect(0) == [leased.digest]
    assert list(store.layers_dir.iterdir()) == [] and list(store.blobs.iterdir()) == []
    assert list(store.refs_dir.iterdir()) == []


def test_blob_corrupted_in_staging_after_a_crash_is_refused_then_fetched_again(
    registry, store, tmp_path
):
    top = layer([E("c", data=b"content")])
    push(registry, tmp_path, "t/staged", [BB, top])
    ref = f"{registry.host}/t/staged:v1"
    top_hex = hashlib.sha256(top[0]).hexdigest()

    def crash(stage: str) -> None:
        raise KeyboardInterrupt(stage)

    store.fault_hook = crash
    with pytest.raises(KeyboardInterrupt):
        store.pull(ref, credentials=CREDS)
    staged = next(store.staging.glob(f"*/blobs/sha256/{top_hex}"))
    staged.write_bytes(b"bit rot")  # skopeo trusts a blob the layout already has

    store.fault_hook = None
    with pytest.raises(DigestMismatch, match=top_hex):
        store.pull(ref, credentials=CREDS)
    assert not staged.exists() and not (store.blobs / top_hex).exists()
    rec = store.pull(ref, credentials=CREDS)  # fetched again, verified
    assert (store.lower_dirs(rec)[0] / "c").read_bytes() == b"content"
    assert registry.blob_gets("t/staged", "sha256:" + top_hex) == 2


def test_touch_makes_an_image_recently_used(registry, store, tmp_path):
    for name in ("first", "second"):
        push(registry, tmp_path, f"t/lru-{name}", [layer([E(name, data=os.urandom(20_000))])])
    first = store.pull(f"{registry.host}/t/lru-first:v1", credentials=CREDS)
    second = store.pull(f"{registry.host}/t/lru-second:v1", credentials=CREDS)
    store.touch(first.digest)  # a sandbox started from it now
    assert store.collect(store.usage() - 1) == [second.digest]
    assert store.get(first.digest) is not None
    store.touch(second.digest)  # collected: touching it does not bring the record back
    assert store.get(second.digest) is None


def test_lease_stored_only_leases_a_complete_image_and_asks_no_registry(registry, store, tmp_path):
    push(registry, tmp_path, "t/lease-stored", [BB, layer([E("top", data=b"x")])])
    ref = f"{registry.host}/t/lease-stored:v1"
    digest = store.resolve(ref, credentials=CREDS)
    assert store.lease_stored(digest, "sb-early") is None  # nothing stored yet
    assert store.leased() == {}
    rec = store.pull(ref, credentials=CREDS)
    before = (registry.manifest_gets("t/lease-stored"), registry.blob_gets("t/lease-stored"))
    leased = store.lease_stored(digest, "sb-1")
    assert leased is not None and leased.digest == digest and leased.layers == rec.layers
    assert leased.last_used >= rec.last_used
    assert store.leased() == {"sb-1": digest}
    # the store alone: no manifest and no blob fetched
    after = (registry.manifest_gets("t/lease-stored"), registry.blob_gets("t/lease-stored"))
    assert after == before
    # a collection meanwhile cannot take the leased image
    assert store.collect(0) == [] and store.get(digest) is not None
    # an image missing one layer (a half-collected store) is not leased: pull it
    os.rename(store.layer_path(rec.layers[1].digest).parent, tmp_path / "gone")
    assert store.lease_stored(digest, "sb-2") is None
    assert store.leased() == {"sb-1": digest}
