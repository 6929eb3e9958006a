from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "apps.sandboxes"
    label = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from apps.billing.quotas import register_use_reader
        from apps.core.nav import NavItem, register_nav
        from apps.sandboxes.admission.use import quota_use
        from apps.sandboxes.metering.usage import on_sandbox_event
        from apps.sandboxes.models import SandboxEvent
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

        # Billing sits a floor below and never imports this app: its quota report reads
        # a tenant's use through this reader, and the usage ledger follows the
        # lifecycle ledger row by row through this hook, inside the same transaction,
        # so a transition and its metering commit together.
        register_use_reader(quota_use)

        def _metered(sender: object, instance: SandboxEvent, created: bool, **_: object) -> None:
            if created:
                on_sandbox_event(instance)

        post_save.connect(_metered, sender=SandboxEvent, weak=False, dispatch_uid="billing-usage")
