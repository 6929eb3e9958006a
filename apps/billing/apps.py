from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "apps.billing"
    label = "billing"
    verbose_name = "Tenants, keys and billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from apps.billing.usage import on_sandbox_event
        from apps.core.nav import NavItem, register_nav
        from apps.sandboxes.models import SandboxEvent

        register_nav(NavItem("Usage", "billing:usage", section="usage"), before="API keys")

        def _metered(sender: object, instance: SandboxEvent, created: bool, **_: object) -> None:
            # The usage ledger follows the lifecycle ledger row by row, inside the same
            # transaction, so a transition and its metering commit together.
            if created:
                on_sandbox_event(instance)

        post_save.connect(_metered, sender=SandboxEvent, weak=False, dispatch_uid="billing-usage")
