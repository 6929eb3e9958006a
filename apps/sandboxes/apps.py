from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "apps.sandboxes"
    label = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.core.nav import NavItem, register_nav
        from apps.sandboxes.services.warm_pool import warm_pool_targets

        # A malformed HEDGEROW_WARM_POOL stops the process now, not at the first create.
        warm_pool_targets()

        # The kubernetes backend's refusals (no pod boundary, an unpinned injector image)
        # stop every process at start, not at the first sandbox.
        from django.conf import settings

        if settings.HEDGEROW_BACKEND == "kubernetes":
            from apps.sandboxes.backends.kubernetes import check_startup

            check_startup()

        # A team's own leak audit history (the installation-wide report is staff-only).
        register_nav(NavItem("Leaks", "tenant-leaks", section="leaks"))
