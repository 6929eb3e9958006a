from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "apps.sandboxes"
    label = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from frontend.nav import NavItem, register_nav

        # A team's own leak audit history (the installation-wide report is staff-only).
        register_nav(NavItem("Leaks", "tenant-leaks", section="leaks"))
