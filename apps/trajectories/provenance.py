"""Provenance keys (docs/trajectories.md, "Provenance"): a stable, content-derived key per
episode from what made it — the task's content hash, the initial state (image digest and,
when forked, the snapshot), the policy checkpoint, the harness commit, the verifier
commit or version, the sampling parameters and the attempt.

Pure functions of plain values (no models), so the backfill migration computes exactly
what the services compute. A component nobody supplied is the explicit ``unknown``,
never an empty string; ``snapshot`` is ``none`` for an episode that did not start from a
snapshot (known not to be forked).

* ``key``    — every component: this exact rollout's origin, attempt included;
* ``origin`` — every component except ``attempt``: episodes with equal origins are
  comparable rollouts of the same thing ("same origin").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

UNKNOWN = "unknown"
NONE = "none"
KEY_VERSION = "hp1"
# In key order. The API filters (``provenance.<name>=``) and groups by these names.
COMPONENTS = ("task", "image", "snapshot", "policy", "harness", "verifier", "sampling", "attempt")
ORIGIN_COMPONENTS = tuple(c for c in COMPONENTS if c != "attempt")
# What a client may supply on open (the SDK's ``sb.episode(task_hash=…, …)``).
INPUT_FIELDS = ("task_hash", "policy_checkpoint", "harness_commit", "verifier_commit")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sampling_digest(sampling: Any) -> str:
    """``sha256:<16 hex>`` of the canonical JSON of the sampling parameters, or
    ``unknown`` when none were given."""
    if not sampling:
        return UNKNOWN
    return "sha256:" + hashlib.sha256(canonical_json(sampling).encode()).hexdigest()[:16]


def _or_unknown(*values: Any) -> str:
    for value in values:
        if value is not None and str(value).strip():
            return str(value).strip()
    return UNKNOWN


def components(
    *,
    task_hash: str = "",
    image_digest: str = "",
    snapshot_id: str | None = None,
    policy_checkpoint: str = "",
    policy_version: str = "",
    harness_commit: str = "",
    verifier_commit: str = "",
    verifier_version: str = "",
    sampling: Any = None,
    attempt_id: str = "",
) -> dict[str, str]:
    """The components from an episode's fields. ``policy`` falls back to the
    ``policy_version`` (a checkpoint name such as ``step-1200``), ``verifier`` to the
    verifier's version; nothing else is guessed (a harness *version* is not a commit)."""
    return {
        "task": _or_unknown(task_hash),
        "image": _or_unknown(image_digest),
        "snapshot": str(snapshot_id) if snapshot_id else NONE,
        "policy": _or_unknown(policy_checkpoint, policy_version),
        "harness": _or_unknown(harness_commit),
        "verifier": _or_unknown(verifier_commit, verifier_version),
        "sampling": sampling_digest(sampling),
        "attempt": _or_unknown(attempt_id),
    }


def _digest(parts: dict[str, str], names: tuple[str, ...]) -> str:
    body = canonical_json([[name, parts[name]] for name in names])
    return f"{KEY_VERSION}:" + hashlib.sha256(body.encode()).hexdigest()


def key_of(parts: dict[str, str]) -> str:
    return _digest(parts, COMPONENTS)


def origin_of(parts: dict[str, str]) -> str:
    return _digest(parts, ORIGIN_COMPONENTS)


def clean_components(value: Any) -> dict[str, str] | None:
    """An imported record's components, if they are a complete set of strings (else
    None: the caller computes them from the record's fields)."""
    if not isinstance(value, dict):
        return None
    parts = {name: value.get(name) for name in COMPONENTS}
    if not all(isinstance(v, str) and v and len(v) <= 200 for v in parts.values()):
        return None
    return {k: str(v) for k, v in parts.items()}
