"""The JSON shapes the API answers, as ``TypedDict``s: what ``sandbox.data``,
``episode.data`` / ``episode.close()`` and ``snapshot.data`` hold. Keys are the
server's fields (sdk/tests/test_shapes.py compares them with the server's serializers,
so a field added or renamed there fails that test until it is named here). Times are
ISO 8601 strings, money a decimal string in USD; ``total=False`` because handles made
from an id alone (``{"id": ...}``) hold only what is known so far."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, TypedDict


class PullProgress(TypedDict, total=False):
    """An image pull while ``provisioning``: bytes so far of ``total`` (None unknown)."""

    phase: str
    layers: int
    bytes: int
    total: Optional[int]


class SandboxData(TypedDict, total=False):
    """``GET /sandboxes/{id}`` (and every answer that returns a sandbox)."""

    id: str
    state: str  # requested, queued, provisioning, ready, paused, deleting, deleted, failed, lost
    generation: int  # +1 at each resume/restore
    image: str
    image_digest: str  # '' for host
    progress: Optional[PullProgress]
    cpu: str  # "1000m"
    cpu_millis: int
    memory: str  # "1024Mi"
    memory_mib: int
    network_access: bool
    egress: Any  # docs/egress.md
    isolation: str
    backend: str
    node: str
    labels: Dict[str, str]
    ttl_seconds: Optional[int]
    expires_at: Optional[str]
    heartbeat_timeout_s: Optional[int]
    last_heartbeat_at: Optional[str]
    status_message: str
    created_at: str
    ready_at: Optional[str]
    terminated_at: Optional[str]
    queue_position: Optional[int]  # 1-based while queued
    cost: Optional[str]  # USD so far
    from_snapshot: Optional[str]
    divergence: Optional[List[Dict[str, Any]]]


class ResourceExhausted(TypedDict, total=False):
    """``ExecResult.resource_exhausted``: the sandbox's own limit ended or crippled the
    command (read from the cgroup's counters, never guessed from an exit code)."""

    code: str  # "resource_exhausted"
    message: str
    kind: str  # memory, pids, disk, …
    limit: Any  # the limit that was reached, in that kind's unit
    signal: Optional[int]


class Fingerprint(TypedDict, total=False):
    """``Snapshot.fingerprint`` (docs/snapshots.md, Fingerprints)."""

    tree: str  # "sha256:…" over paths, types, modes, owners, sizes, contents
    files: int
    probes: Dict[str, Dict[str, Any]]  # name → {exit_code, stdout, stdout_sha256}
    ports: List[Dict[str, Any]]  # [{proto, address, port}]
    processes: List[List[str]]  # argv of each process
    env: Dict[str, str]  # secret-like values as a "sha256:" prefix
    volatile: List[str]  # what is shown but never compared


class SnapshotData(TypedDict, total=False):
    """``GET /snapshots/{id}`` (docs/snapshots.md)."""

    id: str
    name: str
    kind: str
    state: str
    sandbox: str
    parent: Optional[str]
    image: str
    image_digest: str
    generation: int
    manifest: Dict[str, Any]
    probes: Any
    fingerprint: Fingerprint
    size_bytes: Optional[int]
    capture_s: Optional[float]
    capture_wall_s: Optional[float]
    error: Optional[Dict[str, Any]]  # {code, message} when the capture failed
    ttl_seconds: Optional[int]
    expires_at: Optional[str]
    created_at: str
    captured_at: Optional[str]
    deleted_at: Optional[str]
    storage_cost: Optional[str]


class EpisodeData(TypedDict, total=False):
    """``POST /episodes`` and ``POST /episodes/{id}/close`` (docs/trajectories.md)."""

    id: str
    status: str
    task_id: str
    task_version: str
    image: str
    image_digest: str
    initial_state: Any
    model: str
    model_version: str
    harness: str
    harness_version: str
    policy_version: str
    attempt_id: str
    sampling: Dict[str, Any]
    labels: Dict[str, str]
    started_at: str
    ended_at: Optional[str]
    termination_reason: str
    reward: Optional[float]
    reward_components: Dict[str, Any]
    verifier_name: str
    verifier_version: str
    verifier_outcome: str
    inference_error: str
    versions: Dict[str, Any]
    resources: Dict[str, Any]
    cost: Optional[str]
    client_cost: Optional[str]
    cost_basis: str
    failure_class: str
    auto_failure_class: str
    claimed_class: str
    failure_evidence: Any
    valid: bool
    relabeled: Any
    reattributions: List[Any]
    imported: bool
    sandboxes: List[Any]
    parent: Optional[str]
    branch_step: Optional[int]
    branch_snapshot: Optional[str]
    task_hash: str
    policy_checkpoint: str
    harness_commit: str
    verifier_commit: str
    provenance: Dict[str, Any]


__all__ = [
    "EpisodeData",
    "Fingerprint",
    "PullProgress",
    "ResourceExhausted",
    "SandboxData",
    "SnapshotData",
]
