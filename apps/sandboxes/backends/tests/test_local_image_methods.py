"""The local backend's image methods (the backend contract of issue 15) over the image
store, against the real registry fixture: typed errors with stable codes, never a
fallback, and a cached proof of access per credentials only."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import ImageUnavailable, RegistryCredentials, UnknownImage
from apps.sandboxes.backends.local import LocalBackend
from apps.sandboxes.backends.local.images.tests.ocibuild import Layout, busybox_layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry

from .conftest import make_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root")
CREDS = RegistryCredentials(USER, PASSWORD)


@pytest.fixture
def local(tmp_path: Path) -> LocalBackend:
    # plain processes: these methods never touch a network namespace
    return LocalBackend(make_config(tmp_path, f"im{os.getpid()}", "none"))


def _push(registry: Registry, tmp: Path, repo: str) -> str:
    lay = Layout(tmp / f"layout-{repo.replace('/', '-')}")
    desc = lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]})
    lay.tag("v1", desc)
    lay.push("v1", f"{registry.host}/{repo}:v1", registry.creds)
    return str(desc["digest"])


def test_resolve_then_pull_then_remove(registry: Registry, local: LocalBackend, tmp_path: Path):
    digest = _push(registry, tmp_path, "methods/bb")
    ref = f"{registry.host}/methods/bb:v1"
    info = local.resolve_image(ref, CREDS)
    assert info.digest == digest and info.layers == 0  # manifest only: nothing fetched
    pulled = local.pull_image(ref, CREDS)
    assert (pulled.digest, pulled.layers, pulled.name) == (digest, 1, ref)
    assert pulled.size_bytes > 0
    assert digest in {i.digest for i in local.images()}
    assert local.resolve_image(ref, CREDS).layers == 1
    assert local.remove_image(digest) is True
    assert digest not in {i.digest for i in local.images()}


def test_typed_errors_name_the_image_and_cause(registry: Registry, local: LocalBackend):
    missing = f"{registry.host}/methods/nothing:v1"
    cases = {
        missing: "image_not_found",
        "Not A Reference!": "image_reference_invalid",
        "127.0.0.1:1/methods/bb:v1": "registry_forbidden",  # loopback, not listed
    }
    for ref, code in cases.items():
        with pytest.raises(ImageUnavailable) as err:
            local.resolve_image(ref, CREDS)
        assert err.value.code == code, (ref, err.value)
        assert err.value.reference == ref


def test_access_is_proved_per_credentials(registry: Registry, local: LocalBackend, tmp_path: Path):
    _push(registry, tmp_path, "methods/private")
    ref = f"{registry.host}/methods/private:v1"
    local.pull_image(ref, CREDS)  # cached now, and a positive answer is remembered
    for creds in (None, RegistryCredentials(USER, "wrong")):
        with pytest.raises(ImageUnavailable) as err:
            local.resolve_image(ref, creds)
        assert err.value.code == "registry_unauthorized"


def test_a_name_that_is_no_image_is_never_host(local: LocalBackend):
    assert local.resolve_image("host").name == "host"
    # a bare name nobody imported is a Docker Hub reference (unreachable from here),
    # never the host and never a silent stand-in
    with pytest.raises(ImageUnavailable) as err:
        local.resolve_image("hostx")
    assert err.value.code == "registry_unreachable" and not isinstance(err.value, UnknownImage)


def test_import_oci_layout_dir(local: LocalBackend, tmp_path: Path):
    lay = Layout(tmp_path / "layout")
    desc = lay.image([busybox_layer()], {})
    lay.tag("v1", desc)
    info = local.import_image("import/bb:v1", lay.path)
    assert info.digest == desc["digest"] and info.layers == 1


def test_concurrent_resolves_of_one_key_ask_the_registry_once(
    registry: Registry, local: LocalBackend, tmp_path: Path
):
    digest = _push(registry, tmp_path, "methods/flight")
    ref = f"{registry.host}/methods/flight:v1"
    before = registry.manifest_gets("methods/flight")
    barrier = threading.Barrier(12)

    def resolve(creds: RegistryCredentials | None) -> str:
        barrier.wait()
        try:
            return local.resolve_image(ref, creds).digest
        except ImageUnavailable as exc:
            return exc.code

    with ThreadPoolExecutor(12) as pool:
        # 8 creates with the right login, 4 with none: two keys, two round trips
        answers = list(pool.map(resolve, [CREDS] * 8 + [None] * 4))
    assert answers == [digest] * 8 + ["registry_unauthorized"] * 4
    # one manifest GET for the login (the anonymous attempts are refused with 401)
    assert registry.manifest_gets("methods/flight") == before + 1
    # a refusal is not remembered: the next anonymous ask goes to the registry again
    with pytest.raises(ImageUnavailable):
        local.resolve_image(ref, None)
    assert local.resolve_image(ref, CREDS).digest == digest  # cached: no new GET
    assert registry.manifest_gets("methods/flight") == before + 1
