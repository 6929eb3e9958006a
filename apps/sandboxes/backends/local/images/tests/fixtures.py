"""Registry fixtures for every test (the root conftest.py loads this plugin).

A real registry on loopback: Debian's docker-registry (the reference server).

One per test session with htpasswd auth and one without, each in a tmp dir on a free
loopback port, stopped after. Its access log is kept so tests can count blob GETs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry, start
from apps.sandboxes.backends.local.images.tests.swe import push_swe_image

__all__ = ["PASSWORD", "USER", "Registry", "SweImage"]


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry that requires htpasswd (basic) auth."""
    proc, reg = start(tmp_path_factory.mktemp("registry-auth"), auth=True)
    try:
        yield reg
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def open_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An anonymous registry (no auth), like a public one."""
    proc, reg = start(tmp_path_factory.mktemp("registry-open"), auth=False)
    try:
        yield reg
    finally:
        proc.terminate()
        proc.wait(10)


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
