"""Typed errors of the image store: one class per cause, each with a stable ``code``.

The control plane maps ``code`` to a 4xx answer (REST, /orchard, SDK) without parsing
messages; ``message`` carries the registry's own words (or skopeo's) for the user.
"""

from __future__ import annotations


class ImageError(Exception):
    code = "image_error"

    def __init__(self, reference: str, message: str) -> None:
        super().__init__(f"{reference}: {message}")
        self.reference = reference
        self.message = message


class InvalidReference(ImageError):
    code = "image_reference_invalid"


class ImageNotFound(ImageError):
    """The registry has no such repository, tag or digest."""

    code = "image_not_found"


class RegistryUnauthorized(ImageError):
    """Credentials missing or refused (the registry does not tell which)."""

    code = "registry_unauthorized"


class RegistryUnreachable(ImageError):
    """Connection refused, DNS, TLS, timeouts: the registry could not be asked."""

    code = "registry_unreachable"


class DigestMismatch(ImageError):
    """A blob's content does not hash to the digest that names it: refused, not stored."""

    code = "image_digest_mismatch"


class UnsupportedPlatform(ImageError):
    """The image (or its index) has no manifest for this machine's platform."""

    code = "image_platform_unsupported"


class LayerRefused(ImageError):
    """A layer holds what a sandbox root must not: a device node, a path leaving it."""

    code = "image_layer_refused"


class InvalidArchive(ImageError):
    """An imported file or directory is not a docker save tarball or an OCI layout."""

    code = "image_archive_invalid"


class DiskExhausted(ImageError):
    """The pull would leave less free space than the configured reserve."""

    code = "disk_exhausted"


class ImageStoreError(ImageError):
    """Anything else (skopeo missing or failing in a way not classified above)."""

    code = "image_store_error"
