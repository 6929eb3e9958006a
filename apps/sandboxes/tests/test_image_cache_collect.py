"""The periodic image cache collection (beat task ``collect-image-cache``) against the
configured local backend, with images pulled from the real loopback registry into a
store of this test's own."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from apps.sandboxes import tasks
from apps.sandboxes.backends import get_backend, registry_policy
from apps.sandboxes.backends.local import LocalBackend
from apps.sandboxes.backends.local.backend import lease_holder
from apps.sandboxes.backends.local.images import Credentials, ImageStore
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry

pytestmark = [pytest.mark.timeout(180)]

CREDS = Credentials(USER, PASSWORD)


def _push(registry: Registry, tmp: Path, repo: str) -> str:
    lay = Layout(tmp / f"layout-{repo.replace('/', '-')}")
    own = layer([E(repo.replace("/", "-"), data=os.urandom(200_000))])
    lay.tag("v1", lay.image([busybox_layer(), own]))
    lay.push("v1", f"{registry.host}/{repo}:v1", registry.creds)
    return f"{registry.host}/{repo}:v1"


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalBackend]:
    b = get_backend()
    assert isinstance(b, LocalBackend)
    monkeypatch.setattr(b, "_store", ImageStore(tmp_path / "images", policy=registry_policy))
    # a cap of 1 byte: everything collectable is over it
    monkeypatch.setattr(b, "config", dataclasses.replace(b.config, image_cache_bytes=1))
    yield b


def test_it_is_scheduled() -> None:
    entry = settings.CELERY_BEAT_SCHEDULE["collect-image-cache"]
    assert entry["task"] == "apps.sandboxes.tasks.collect_image_cache"
    assert entry["schedule"] == settings.HEDGEROW_IMAGE_COLLECT_INTERVAL_S


def test_collection_keeps_a_live_sandboxs_image_and_removes_unused_ones_over_the_cap(
    backend: LocalBackend, registry: Registry, tmp_path: Path
) -> None:
    store = backend._store
    assert store is not None
    sid = uuid.uuid4().hex
    holder = lease_holder(backend.config.instance, sid)
    used = store.pull(_push(registry, tmp_path, "t/cc-used"), credentials=CREDS, lease=holder)
    unused = store.pull(_push(registry, tmp_path, "t/cc-unused"), credentials=CREDS)
    shared = used.layers[0].digest
    assert shared == unused.layers[0].digest  # busybox: one layer dir for both

    result = tasks.collect_image_cache.apply().get()

    assert result == {"removed": 1, "digests": [unused.digest]}
    assert store.get(unused.digest) is None
    assert not store.layer_path(unused.layers[1].digest).exists()
    assert not (store.blobs / unused.layers[1].digest.split(":")[1]).exists()
    # the live sandbox's image, every layer of it (the shared one too), stays whole
    assert store.get(used.digest) is not None
    assert all(p.is_dir() and any(p.iterdir()) for p in store.lower_dirs(used))
    assert store.layer_path(shared).is_dir()

    # once the sandbox is gone (lease released), its image is collectable too
    store.release(holder)
    assert tasks.collect_image_cache.apply().get() == {"removed": 1, "digests": [used.digest]}
    assert store.records() == [] and list(store.layers_dir.iterdir()) == []


def test_an_image_under_the_cap_is_kept(
    backend: LocalBackend, registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = backend._store
    assert store is not None
    rec = store.pull(_push(registry, tmp_path, "t/cc-small"), credentials=CREDS)
    monkeypatch.setattr(
        backend, "config", dataclasses.replace(backend.config, image_cache_bytes=store.usage())
    )

    assert tasks.collect_image_cache.apply().get() == {"removed": 0, "digests": []}
    assert store.get(rec.digest) is not None
