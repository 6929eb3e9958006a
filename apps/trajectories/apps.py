from django.apps import AppConfig


class TrajectoriesConfig(AppConfig):
    name = "apps.trajectories"
    label = "trajectories"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.core.nav import NavItem, register_nav

        register_nav(NavItem("Trajectories", "trajectories:list", section="trajectories"))
