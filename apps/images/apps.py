from django.apps import AppConfig


class ImagesConfig(AppConfig):
    """OCI images and registry credentials as tenant resources (issue 15)."""

    name = "apps.images"
    label = "images"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.core.nav import NavItem, register_nav

        register_nav(NavItem("Images", "images:list", section="images"), before="Usage")
