from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "apps.sandboxes"
    label = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"
