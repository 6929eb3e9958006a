"""A reused sandbox IP keeps its MAC, so the host's neighbour cache never goes stale."""

from __future__ import annotations

import json
import subprocess

from apps.sandboxes.backends.local.backend import LocalBackend

from .conftest import needs_root, new_spec

pytestmark = needs_root


def _inner_mac(backend: LocalBackend, sandbox_id: str) -> str:
    ns = backend.network.names.netns(sandbox_id)
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "link", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return str(json.loads(out)[0]["address"])


def test_it_gives_a_reused_address_the_same_mac(backend: LocalBackend) -> None:
    first = new_spec()
    endpoint = backend.provision(first)
    mac = _inner_mac(backend, first.sandbox_id)
    backend.destroy(first.sandbox_id)
    second = new_spec()
    try:
        again = backend.provision(second)
        if again.host == endpoint.host:  # the address pool handed the same IP back
            assert _inner_mac(backend, second.sandbox_id) == mac
        octets = [int(p) for p in again.host.split(".")]
        assert _inner_mac(backend, second.sandbox_id) == "02:68:" + ":".join(
            f"{o:02x}" for o in octets
        )
    finally:
        backend.destroy(second.sandbox_id)
