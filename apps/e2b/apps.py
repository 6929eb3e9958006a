from django.apps import AppConfig


class E2BConfig(AppConfig):
    name = "apps.e2b"
    label = "e2b"
    verbose_name = "E2B compatibility"
