"""The image cache's periodic collection (issue 15; docs/images.md, "Collection").

The local backend's machine-wide OCI store grows with every image pulled; the beat
task ``collect-image-cache`` shrinks it to ``HEDGEROW_IMAGE_CACHE_MIB``, least
recently used images first. An image a sandbox runs is never collected: every
sandbox holds a lease on its image in the store itself (``leases/<instance>.<sid>``,
taken before its pull ends), which covers the sandboxes of every instance on the
machine, not only those in this database. Backends without an image cache
(Kubernetes: the nodes' container runtime has its own) are skipped.
"""

from __future__ import annotations

import logging
from typing import Any

from apps.sandboxes.backends import get_backend

log = logging.getLogger(__name__)


def image_cache_collect() -> dict[str, Any]:
    """Collects the backend's image cache once; returns what was removed."""
    backend = get_backend()
    collect = getattr(backend, "collect_images", None)
    if not callable(collect):
        return {"skipped": f"the {backend.name} backend has no image cache"}
    removed: list[str] = list(collect())
    if removed:
        log.info(
            "image cache collected: %d image(s) removed",
            len(removed),
            extra={"event": "image_cache_collect", "digests": removed},
        )
    return {"removed": len(removed), "digests": removed}
