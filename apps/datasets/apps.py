from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "apps.datasets"
    label = "datasets"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.datasets import signals
        from frontend.nav import NavItem, register_nav

        signals.connect()
        register_nav(NavItem("Datasets", "datasets:list", section="datasets"))
