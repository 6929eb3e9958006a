"""The images registry sandboxes ask instead of importing ``apps.images`` (issue 18;
docs/architecture.md, "Images and sandboxes")."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from apps.images.services import Catalog
from apps.sandboxes import image_catalog as registry


def test_the_images_app_registers_its_catalog_at_startup() -> None:
    assert isinstance(registry.image_catalog(), Catalog)


def test_without_a_registered_catalog_a_create_fails_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "_catalog", None)
    with pytest.raises(ImproperlyConfigured, match=r"apps\.images"):
        registry.image_catalog()


def test_registering_replaces_the_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_catalog", None)
    catalog = Catalog()
    registry.register_image_catalog(catalog)
    assert registry.image_catalog() is catalog
