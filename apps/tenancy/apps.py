from django.apps import AppConfig


class TenancyConfig(AppConfig):
    """Tenants, members, API keys, principals and authentication: the floor every
    other app stands on. It imports no other app (the import contract says so)."""

    name = "apps.tenancy"
    label = "tenancy"
    verbose_name = "Tenants, members and keys"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # registers the schema's security schemes for our authentication classes
        from apps.tenancy import openapi  # noqa: F401
