"""The one interface every sandbox backend implements.

Nothing outside ``apps/sandboxes/backends/`` imports ``kubernetes`` or runs
``ip``/``bwrap``/``nft``: services and tasks only see these types.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


class BackendError(Exception):
    """A backend operation failed. ``transient`` errors may be retried."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class UnknownImage(BackendError):
    pass


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str  # the control plane's UUID (hex, no dashes)
    tenant_id: str
    generation: int
    image: str
    cpu_millis: int
    memory_mib: int
    network_access: bool  # False: no egress at all
    agent_token: str  # plaintext only in memory; the backend hands it to the agent privately
    pids_limit: int = 512
    disk_mib: int = 2048
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Endpoint:
    host: str  # the sandbox's own IP: the hot path goes here directly
    port: int
    isolation: str  # "netns+bwrap", "pod", "pod+gvisor", … or "none" (unisolated fallback)
    node: str = ""


@dataclass(frozen=True)
class InventoryItem:
    """One backend resource. ``sandbox_id`` is None when the name cannot be parsed."""

    # netns, process, cgroup, directory, nft_rule, veth, address, pod, network_policy, secret
    kind: str
    name: str
    sandbox_id: str | None
    generation: int | None = None
    node: str = ""


@dataclass(frozen=True)
class BackendEvent:
    """Something happened to a sandbox's resource outside the control plane's request."""

    sandbox_id: str
    generation: int | None
    kind: str  # "ready", "gone", "failed"
    reason: str = ""
    endpoint: Endpoint | None = None


@dataclass(frozen=True)
class ImageInfo:
    name: str
    description: str = ""
    digest: str = ""


class Backend(Protocol):
    name: str

    def images(self) -> list[ImageInfo]:
        """Images this backend can start; anything else is UnknownImage."""

    def provision(self, spec: SandboxSpec) -> Endpoint:
        """Create every resource for (sandbox, generation) and start the agent.

        Idempotent: resources that already exist with the same sandbox id and
        generation are adopted. On failure it removes what it created and raises.
        Returns once the agent process is started (readiness is checked by the
        caller against ``/health``).
        """

    def destroy(self, sandbox_id: str) -> None:
        """Remove every trace of the sandbox (all generations). Idempotent."""

    def endpoint(self, sandbox_id: str) -> Endpoint | None:
        """Where the agent of a live sandbox listens, or None if it has none."""

    def inventory(self) -> list[InventoryItem]:
        """Every resource this installation owns. Raises BackendError when the
        listing is incomplete, so callers never act on a partial view."""

    def reclaim(self, item: InventoryItem) -> None:
        """Remove one leaked resource. Idempotent."""

    def watch(self, timeout_s: float) -> Iterator[BackendEvent]:
        """Events observed for up to ``timeout_s`` (e.g. an agent process that died)."""
