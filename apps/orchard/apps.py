from django.apps import AppConfig


class OrchardConfig(AppConfig):
    name = "apps.orchard"
    label = "orchard"
    verbose_name = "Orchard Env compatibility"
