"""The one interface every sandbox backend implements.

Nothing outside ``apps/sandboxes/backends/`` imports ``kubernetes`` or runs
``ip``/``bwrap``/``nft``: services and tasks only see these types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from apps.core.egress import ALL, NONE, EgressPolicy


class BackendError(Exception):
    """A backend operation failed. ``transient`` errors may be retried."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class ImageUnavailable(BackendError):
    """The image cannot be had: not found, unauthorized, unreachable registry, tampered
    blob, refused layer, unsupported platform, unknown ``User``… ``code`` is stable
    (``image_not_found``, ``registry_unauthorized``, … — docs/images.md) and becomes
    the API's 4xx error code; ``message`` carries the registry's own words. Never a
    reason to fall back to another image."""

    def __init__(
        self, message: str, *, code: str = "image_unavailable", reference: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reference = reference


class UnknownImage(ImageUnavailable):
    """A name that is neither an OCI reference nor an image this backend has."""

    def __init__(self, message: str, *, reference: str = "") -> None:
        super().__init__(message, code="unknown_image", reference=reference)


class DiskExhausted(BackendError):
    """The host's disk (image cache or sandbox storage) would fall below its reserve:
    new sandboxes and pulls are refused before the disk fills (``disk_exhausted``)."""

    code = "disk_exhausted"


class UnprotectedLaunch(BackendError):
    """The local backend would start the agent by exec launch, where a command can
    kill or renice it (no uid split, no guard filter): refused unless the operator
    opted in (``HEDGEROW_LOCAL_ALLOW_UNPROTECTED_EXEC_LAUNCH``). Nothing is created."""

    code = "unprotected_agent_launch"


class SnapshotFailed(BackendError):
    """A capture that did not complete (the sandbox is gone or not running, the
    storage refused the snapshot, …): nothing of it is left and nothing is reported
    as captured. ``code`` is the API's (``snapshot_failed``, ``sandbox_not_running``)."""

    def __init__(self, message: str, *, code: str = "snapshot_failed") -> None:
        super().__init__(message)
        self.code = code


class SnapshotNotFound(BackendError):
    """No such snapshot on this backend (deleted, or never captured here)."""

    code = "snapshot_not_found"


class StateDivergence(BackendError):
    """A restored sandbox's state is not the snapshot's: ``diff`` lists what differs
    (``{"path", "expected", "actual"}``; a missing side is null)."""

    code = "state_divergence"

    def __init__(self, message: str, *, diff: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.diff = diff


class MetricsUnavailable(BackendError):
    """This backend (or this sandbox, gone or without cgroups) has no resource counters
    to read: the API answers 409 ``metrics_unavailable``."""

    code = "metrics_unavailable"


@dataclass(frozen=True)
class SandboxMetrics:
    """One sample of a live sandbox's counters, read from its cgroups (docs/frontend.md
    "Metrics"). ``cpu_usage_ns`` is cumulative: a rate needs two samples."""

    ts: float  # unix time of the read
    memory_bytes: int  # memory charged to the sandbox's cgroup (page cache included)
    cpu_usage_ns: int  # cumulative CPU time
    pids: int  # tasks (threads included) in the sandbox's pids cgroup
    disk_bytes: int | None = None  # bytes its disk quota group references; None: no quota
    cpu_source: str = "cgroup"  # "cgroup" (cpu.stat), or "proc" (v1 without cpuacct)


@dataclass(frozen=True)
class SnapshotInfo:
    """A captured snapshot: the sandbox's writable root (upper dir), /workspace and
    /tmp, read-only, with the tree fingerprint of exactly what was captured."""

    snapshot_id: str
    sandbox_id: str
    image: str  # as the sandbox was created with it ("host", a reference)
    image_digest: str
    fingerprint: str  # "sha256:…" tree hash (docs/snapshots.md)
    files: int  # entries in the tree
    size_bytes: int  # bytes of regular files captured
    capture_s: float  # wall seconds the sandbox was frozen
    captured_at: float  # unix time


@dataclass(frozen=True)
class RegistryCredentials:
    """A tenant's credentials for one registry, decrypted only in memory for a pull."""

    username: str
    password: str

    def __repr__(self) -> str:  # never in logs or tracebacks
        return f"RegistryCredentials(username={self.username!r}, password=***)"


# Pull progress: {"phase": "resolved"|"fetching"|"fetched"|"unpacked"|"done", …}
# (docs/images.md "Progress"); called from the provisioning thread.
ProgressCallback = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str  # the control plane's UUID (hex, no dashes)
    tenant_id: str
    generation: int
    image: str
    cpu_millis: int
    memory_mib: int
    network_access: bool  # False: no egress at all; True: routed ("all" or an allowlist)
    agent_token: str  # plaintext only in memory; the backend hands it to the agent privately
    pids_limit: int = 512
    disk_mib: int = 2048
    labels: dict[str, str] = field(default_factory=dict)
    # for a private image: the tenant's credentials for the image's registry
    registry_credentials: RegistryCredentials | None = field(default=None, repr=False)
    # restore: the sandbox starts from this snapshot's state (``image`` must be the
    # snapshot's); its tree is verified against the snapshot's fingerprint first
    snapshot_id: str = ""
    # The egress policy (apps/core/egress.py); None: "all" or "none" by network_access.
    egress: EgressPolicy | None = None

    @property
    def egress_policy(self) -> EgressPolicy:
        if self.egress is not None:
            return self.egress
        return ALL if self.network_access else NONE


@dataclass(frozen=True)
class Endpoint:
    host: str  # the sandbox's own IP: the hot path goes here directly
    port: int
    isolation: str  # "netns+bwrap", "pod", "pod+gvisor", … or "none" (unisolated fallback)
    node: str = ""
    image_digest: str = ""  # the resolved manifest digest the sandbox runs ("" for host)


@dataclass(frozen=True)
class InventoryItem:
    """One backend resource. ``sandbox_id`` is None when the name cannot be parsed."""

    # netns, process, cgroup, directory, nft_rule, veth, address, pod, network_policy, secret,
    # volume, qgroup, loop, neighbour, image_lease, sandbox_root, image_staging,
    # cilium_network_policy
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
    # why, as a stable code for the ledger (``evicted``, ``node_lost``,
    # ``resource_exhausted``, …); "" = unexplained
    code: str = ""


@dataclass(frozen=True)
class ImageInfo:
    name: str  # the reference as asked for (normalised) or a built-in name ("host")
    description: str = ""
    digest: str = ""  # manifest digest, sha256:…
    size_bytes: int = 0  # on disk, unpacked
    layers: int = 0


class Backend(Protocol):
    name: str

    def images(self) -> list[ImageInfo]:
        """Images this backend can start; anything else is UnknownImage."""

    def resolve_image(
        self, reference: str, credentials: RegistryCredentials | None = None
    ) -> ImageInfo:
        """Check that ``reference`` can be had with ``credentials`` (the manifest, not
        the layers) and return its digest. Raises ImageUnavailable. Cheap enough for a
        create request (the local backend caches a positive answer briefly)."""

    def pull_image(
        self,
        reference: str,
        credentials: RegistryCredentials | None = None,
        progress: ProgressCallback | None = None,
    ) -> ImageInfo:
        """Fetch and unpack the image now (single-flight). Raises ImageUnavailable or
        DiskExhausted."""

    def import_image(self, name: str, archive: Path) -> ImageInfo:
        """Store a ``docker save`` tarball or OCI layout under ``name``."""

    def remove_image(self, digest: str) -> bool:
        """Drop the cached image unless a live sandbox uses it; False when in use."""

    def prepare(self) -> None:
        """Make now what the first provision of a fresh installation would otherwise
        make first (a worker calls it once as it starts): idempotent, best effort; a
        provision still makes whatever is missing."""

    def provision(self, spec: SandboxSpec, progress: ProgressCallback | None = None) -> Endpoint:
        """Create every resource for (sandbox, generation) and start the agent.

        Idempotent: resources that already exist with the same sandbox id and
        generation are adopted. On failure it removes what it created and raises.
        Returns once the agent process is started (readiness is checked by the
        caller against ``/health``). An OCI image is pulled first (``progress`` gets the
        pull's events); the returned endpoint carries its digest.
        """

    def snapshot(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        """Capture the running sandbox's filesystem state as snapshot ``snapshot_id``:
        freeze it, sync, take a read-only copy, thaw. All or nothing: on failure
        nothing is kept and SnapshotFailed is raised. The snapshot keeps its image in
        the cache until ``delete_snapshot``."""

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot and its image lease. Idempotent; sandboxes restored
        from it keep their own copy."""

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
