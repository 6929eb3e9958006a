from django.apps import AppConfig


class ImagesConfig(AppConfig):
    """OCI images and registry credentials as tenant resources (issue 15)."""

    name = "apps.images"
    label = "images"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.core.nav import NavItem, register_nav
        from apps.images.services import Catalog
        from apps.sandboxes.image_catalog import register_image_catalog

        register_nav(NavItem("Images", "images:list", section="images"), before="Usage")
        # Sandboxes sit a floor below and never import this app: a create resolves its
        # image and provisioning finds the registry login through this catalog.
        register_image_catalog(Catalog())
