"""A backend's image pull events as the contract's ``progress`` shape (docs/images.md).

Written by both an image pull (``apps/images``) and a provisioning sandbox
(``services/provisioning.py``), so it lives on the lower floor, here.
"""

from __future__ import annotations

from typing import Any

PROGRESS_MIN_INTERVAL_S = 0.25  # at most 4 progress writes (and UI events) a second


def merge_progress(event: dict[str, Any], last: dict[str, Any] | None = None) -> dict[str, Any]:
    """The contract's progress shape ``{"phase", "layers", "bytes", "total"}`` (and
    ``message`` while a pull backs off, e.g. a registry's rate limit on Kubernetes)."""
    merged = {"phase": "queued", "layers": 0, "bytes": 0, "total": 0, **(last or {})}
    phase = str(event.get("phase", merged["phase"]))
    merged["phase"] = "unpacking" if phase == "unpacked" else phase
    for key in ("layers", "bytes", "total"):
        if isinstance(event.get(key), int):
            merged[key] = event[key]
    if phase == "unpacked" and isinstance(event.get("layer"), int):
        merged["layer"] = event["layer"]
    if isinstance(event.get("message"), str):
        # why the pull is waiting (a registry's refusal the kubelet retries)
        merged["message"] = event["message"][:500]
    elif merged["phase"] != (last or {}).get("phase"):
        merged.pop("message", None)  # it was about the phase before
    return merged
