"""Images pushed to the real registry fixtures (docker-registry on loopback)."""

from __future__ import annotations

import io
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from apps.sandboxes.backends.local.images.tests.ocibuild import Layout, busybox_layer
from apps.sandboxes.backends.local.images.tests.registry import Registry


def push_image(registry: Registry, tmp: Path, repo: str, tag: str = "v1") -> tuple[str, str]:
    """Pushes a one-layer busybox image; returns (reference, manifest digest)."""
    lay = Layout(tmp / f"layout-{uuid.uuid4().hex[:8]}")
    desc = lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]})
    lay.tag(tag, desc)
    ref = f"{registry.host}/{repo}:{tag}"
    lay.push(tag, ref, registry.creds)
    return ref, str(desc["digest"])


def layout_tarball(tmp: Path) -> tuple[bytes, str]:
    """An OCI layout tarball (what `skopeo copy … oci-archive:` or `docker buildx
    --output type=oci` writes); returns (bytes, manifest digest)."""
    lay = Layout(tmp / f"import-{uuid.uuid4().hex[:8]}")
    desc = lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]})
    lay.tag("latest", desc)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(lay.path, arcname=".")
    return buf.getvalue(), str(desc["digest"])


@pytest.fixture
def unique_repo() -> Callable[[str], str]:
    """Repository names unique per test (the registries live for the whole session)."""
    return lambda name: f"t{uuid.uuid4().hex[:10]}/{name}"
