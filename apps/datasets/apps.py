from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "apps.datasets"
    label = "datasets"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.core.nav import NavItem, register_nav
        from apps.datasets import lineage, signals

        signals.connect()
        lineage.connect()  # withdrawals name the datasets they shrink
        register_nav(NavItem("Datasets", "datasets:list", section="datasets"))
