from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "apps.datasets"
    label = "datasets"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.core.nav import NavItem, register_nav
        from apps.datasets import attribution, lineage, signals

        signals.connect()
        attribution.connect()  # a verifier_suspect task's episodes are verifier
        lineage.connect()  # withdrawals name the datasets they shrink
        register_nav(NavItem("Datasets", "datasets:list", section="datasets"))
