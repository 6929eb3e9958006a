"""Registry fixtures for every test (the root conftest.py loads this plugin).

A real registry on loopback: Debian's docker-registry (the reference server).

One per test session with htpasswd auth and one without, each in a tmp dir on a free
loopback port, stopped after. Its access log is kept so tests can count blob GETs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry, start

__all__ = ["PASSWORD", "USER", "Registry"]


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
