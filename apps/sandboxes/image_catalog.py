"""What a sandbox needs to know about images, without importing ``apps.images``.

Images sit a floor above sandboxes (issue 18; docs/architecture.md, "Images and
sandboxes"): an image counts the live sandboxes that run it, publishes on their tenant
topic and pulls through their backend, so ``apps.images`` imports this app. The other
way round, a create must resolve its image with the team's registry login and mark it
used, and provisioning must hand the backend that login. Those three questions are
answered by the catalog ``apps.images`` registers here from its ``AppConfig.ready``
(Baserow's registry pattern): a registry, not an import, so no circle.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from django.core.exceptions import ImproperlyConfigured

from apps.sandboxes.backends.base import RegistryCredentials

if TYPE_CHECKING:
    from apps.tenancy.models import Tenant


class ImageCatalog(Protocol):
    def credentials_for(self, tenant: Tenant, reference: str) -> RegistryCredentials | None:
        """The tenant's login for ``reference``'s registry (decrypted, in memory only),
        or None for an anonymous pull."""

    def resolve_digest(self, tenant: Tenant, image: str) -> str:
        """For a create, synchronously: the digest ``image`` resolves to for this tenant
        ("" for ``host`` and images without one), or a typed 4xx ``ApiError``."""

    def mark_used(self, tenant: Tenant, digests: Iterable[str]) -> None:
        """Records that a sandbox now runs these digests (the images' ``last_used_at``)."""


_catalog: ImageCatalog | None = None


def register_image_catalog(catalog: ImageCatalog) -> None:
    """Called once by ``apps.images`` from its ``AppConfig.ready``."""
    global _catalog
    _catalog = catalog


def image_catalog() -> ImageCatalog:
    if _catalog is None:
        raise ImproperlyConfigured("no image catalog registered (is apps.images installed?)")
    return _catalog
