"""The disk guard (issue 15): new sandboxes are refused before the host's disk fills.

A create (REST, Orchard) is answered ``507 disk_exhausted`` at once, and the warm
pool starts no member, while the backend says a sandbox must not start: on the local
backend, the state dir's or the image store's filesystem below
``HEDGEROW_IMAGE_MIN_FREE_MIB`` free, or the sandbox storage (btrfs) without room for
one sandbox's ``HEDGEROW_SANDBOX_DISK_MIB``. Backends without a ``check_disk``
(Kubernetes: the kubelet evicts on disk pressure) are never refused here.
"""

from __future__ import annotations

from django.conf import settings

from apps.core.errors import ApiError
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import DiskExhausted

INSUFFICIENT_STORAGE = 507


def disk_shortage() -> str | None:
    """Why a new sandbox must not start now, or None. A few statvfs calls."""
    check = getattr(get_backend(), "check_disk", None)
    if not callable(check):
        return None
    try:
        check(
            settings.HEDGEROW_SANDBOX_DISK_MIB << 20,
            min_free_bytes=settings.HEDGEROW_IMAGE_MIN_FREE_MIB << 20,
        )
    except DiskExhausted as exc:
        return str(exc)
    return None


def disk_guard() -> None:
    """Raises the typed 507 (``disk_exhausted``) when ``disk_shortage`` says so."""
    reason = disk_shortage()
    if reason is not None:
        raise ApiError(
            f"not enough disk on the host for a new sandbox: {reason}",
            code=DiskExhausted.code,
            status_code=INSUFFICIENT_STORAGE,
        )
