"""Typed errors of the image store: one class per cause, each with a stable ``code``.

The control plane maps ``code`` to a 4xx answer (REST, /orchard, SDK) without parsing
messages. ``message`` is what the tenant sees: for anything that came from the registry
side (skopeo's stderr) it is the fixed text of ``PUBLIC_MESSAGES`` — skopeo's words
name internal addresses, resolvers and open ports — and the raw text is ``detail``,
for the operator's log only (docs/security.md "Registry egress").
"""

from __future__ import annotations

# The one message per code a tenant sees for errors of the registry side.
PUBLIC_MESSAGES = {
    "image_not_found": "the registry has no such repository, tag or digest",
    "registry_unauthorized": (
        "the registry refused access: no stored login, a rejected one, or a private repository"
    ),
    "registry_unreachable": "the registry could not be reached (connection, DNS, TLS or timeout)",
    "registry_forbidden": (
        "this installation does not contact that registry: its address is loopback, "
        "link-local, private or otherwise non-public, or the operator denies it "
        "(operators allow one with HEDGEROW_REGISTRY_ALLOW)"
    ),
    "image_digest_mismatch": "the registry served content that does not match its digest",
    "image_platform_unsupported": "the image has no manifest for linux/amd64",
    "image_archive_invalid": "not an OCI image layout or a docker save tarball",
    "image_store_error": "the image store could not fetch or use this image",
    "disk_exhausted": "no space left for the image",
}


class ImageError(Exception):
    code = "image_error"

    def __init__(self, reference: str, message: str, *, detail: str | None = None) -> None:
        super().__init__(f"{reference}: {message}")
        self.reference = reference
        self.message = message  # safe to show the tenant
        self.detail = detail if detail is not None else message  # the operator's log


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


class RegistryForbidden(ImageError):
    """The registry's host is not allowed by the registry egress policy (egress.py):
    nothing was sent to it."""

    code = "registry_forbidden"


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
