"""Registry fixtures for every test (the root conftest.py loads this plugin).

A real registry on loopback: Debian's docker-registry (the reference server).

One per test session with htpasswd auth and one without, each in a tmp dir on a free
loopback port, stopped after. Its access log is kept so tests can count blob GETs.

The registry egress policy refuses loopback registries (docs/security.md "Registry
egress"), so a registry must be listed the way an operator lists one: the root
conftest's ``registry`` and ``open_registry`` list these servers in the setting
``HEDGEROW_INSECURE_REGISTRIES`` (Django, which this package must not import); the
store's own tests pass ``listed_policy``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from apps.sandboxes.backends.local.images.egress import RegistryPolicy
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry, start
from apps.sandboxes.backends.local.images.tests.swe import push_swe_image

__all__ = ["PASSWORD", "USER", "Registry", "SweImage"]


@pytest.fixture(scope="session")
def registry_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry that requires htpasswd (basic) auth."""
    proc, reg = start(tmp_path_factory.mktemp("registry-auth"), auth=True)
    try:
        yield reg
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def open_registry_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An anonymous registry (no auth), like a public one."""
    proc, reg = start(tmp_path_factory.mktemp("registry-open"), auth=False)
    try:
        yield reg
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def listed_policy(registry_server: Registry, open_registry_server: Registry) -> RegistryPolicy:
    """The egress policy an operator would configure for these registries."""
    return RegistryPolicy.of(insecure=[registry_server.host, open_registry_server.host])


@dataclass(frozen=True)
class SweImage:
    reference: str
    digest: str


@pytest.fixture(scope="session")
def swe_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> SweImage:
    """The SWE-style task image (swe.py: Debian userland + a failing /testbed), built
    and pushed to the auth registry once per test session."""
    ref = f"{registry.host}/swe/calc:v1"
    return SweImage(ref, push_swe_image(tmp_path_factory.mktemp("swe"), ref, registry.creds))
