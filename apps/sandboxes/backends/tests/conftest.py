"""Fixtures for the local backend tests: a private instance per test session.

No Django here: the backend package is standalone and these tests run with
``-p no:django`` as well as under pytest-django.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.sandboxes.backends import registry_policy
from apps.sandboxes.backends.base import Endpoint, SandboxSpec
from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, wait_healthy

REPO = Path(__file__).resolve().parents[4]
PODAGENT = REPO / "podagent"
IS_ROOT = os.geteuid() == 0
HAS_TOOLS = all(shutil.which(t) for t in ("bwrap", "ip", "nft"))

needs_root = pytest.mark.skipif(not (IS_ROOT and HAS_TOOLS), reason="needs root, bwrap, ip, nft")


def _searchable(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents] if p.exists())


def searchable(path: Path) -> Path:
    """A directory for ``path``'s contents whose ancestors all let others search them.

    Sandboxes run as unprivileged host ids and bwrap binds their dirs from under the
    state dir (and the agent bundle), which the backend checks. pytest's temp root is
    0700 and every pytest session sets it back to 0700 (other runs share it), so a
    path under it is mirrored to /tmp/hedgerow-tests/<hash> (0755), deterministically:
    a subprocess given the mirror gets the same dir back."""
    if _searchable(path):
        return path
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    mirror = SEARCHABLE_ROOT / digest
    mirror.mkdir(parents=True, exist_ok=True)
    os.chmod(SEARCHABLE_ROOT, 0o755)
    os.chmod(mirror, 0o755)
    return mirror


SEARCHABLE_ROOT = Path("/tmp/hedgerow-tests")


# the tests' stand-in outsides: test_local_network.py's and egress_internet.py's
TEST_INTERNETS = ("10.214.0.0/16", "10.216.0.0/16")


def make_config(tmp: Path, instance: str, isolation: str = "auto") -> LocalBackendConfig:
    return LocalBackendConfig(
        state_dir=searchable(tmp) / "state",
        instance=instance,
        podagent_dir=PODAGENT,
        isolation=isolation,
        # not the machine-wide store: a test's pulls, leases and collection stay its own
        image_store=searchable(tmp) / "images",
        # the test registries are listed in the settings (images/tests/fixtures.py)
        registry_policy=registry_policy,
        # the tests' stand-in internets are private ranges: listed as an operator
        # lists one, so egress "all" reaches them (docs/egress.md)
        egress_private_allow=TEST_INTERNETS,
    )


@pytest.fixture(scope="session")
def instance() -> str:
    return f"t{os.getpid()}"


@pytest.fixture(scope="session")
def backend(tmp_path_factory: pytest.TempPathFactory, instance: str) -> Iterator[LocalBackend]:
    if not (IS_ROOT and HAS_TOOLS):
        pytest.skip("needs root, bwrap, ip, nft")
    b = LocalBackend(make_config(tmp_path_factory.mktemp("local"), instance, "netns"))
    try:
        yield b
    finally:
        b.teardown_instance()


def new_spec(**overrides: Any) -> SandboxSpec:
    fields: dict[str, Any] = {
        "sandbox_id": uuid.uuid4().hex,
        "tenant_id": "tenant1",
        "generation": 1,
        "image": "host",
        "cpu_millis": 1000,
        "memory_mib": 256,
        "network_access": False,
        "agent_token": uuid.uuid4().hex,
    }
    fields.update(overrides)
    return SandboxSpec(**fields)


class Sandbox:
    def __init__(self, backend: LocalBackend, spec: SandboxSpec, endpoint: Endpoint) -> None:
        self.backend, self.spec, self.endpoint = backend, spec, endpoint

    @property
    def id(self) -> str:
        return self.spec.sandbox_id

    def exec(self, command: str | list[str], timeout: float = 30) -> dict[str, Any]:
        """Run a command through the real pod agent's /exec."""
        conn = http.client.HTTPConnection(self.endpoint.host, self.endpoint.port, timeout=60)
        body = {"operation_id": f"op-{uuid.uuid4().hex}", "command": command, "timeout": timeout}
        conn.request(
            "POST",
            "/exec",
            json.dumps(body),
            {
                "Authorization": f"Bearer {self.spec.agent_token}",
                "Content-Type": "application/json",
            },
        )
        resp = conn.getresponse()
        data: dict[str, Any] = json.loads(resp.read())
        conn.close()
        assert resp.status == 200, data
        return data

    def sh(self, command: str, timeout: float = 30) -> tuple[int | None, str, str]:
        r = self.exec(command, timeout)
        return (r["termination"]["exit_code"], r["stdout"]["head"], r["stderr"]["head"])


@pytest.fixture
def sandbox_factory(backend: LocalBackend) -> Iterator[Callable[..., Sandbox]]:
    made: list[str] = []

    def make(**overrides: Any) -> Sandbox:
        spec = new_spec(**overrides)
        made.append(spec.sandbox_id)
        endpoint = backend.provision(spec)
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        return Sandbox(backend, spec, endpoint)

    yield make
    for sid in made:
        backend.destroy(sid)


def host_ipv4_addresses() -> list[str]:
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True)
    return [a["local"] for link in json.loads(out.stdout) for a in link.get("addr_info", [])]


# A connect probe run inside sandboxes: prints "open" or the errno name per target.
PROBE = (
    "import socket,sys,errno\n"
    "for t in sys.argv[1:]:\n"
    "    h,p=t.rsplit(':',1); s=socket.socket(); s.settimeout(1.5)\n"
    "    try:\n"
    "        s.connect((h,int(p))); print(t,'open')\n"
    "    except OSError as e:\n"
    "        print(t, errno.errorcode.get(e.errno or 0, str(e)))\n"
    "    finally:\n"
    "        s.close()\n"
)


def probe(sb: Sandbox, targets: list[str]) -> dict[str, str]:
    r = sb.exec(["python3", "-c", PROBE, *targets], timeout=60)
    lines = r["stdout"]["head"].split("\n")
    return dict(line.split(" ", 1) for line in lines if line)
