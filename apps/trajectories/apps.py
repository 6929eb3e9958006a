from typing import Any

from django.apps import AppConfig


class TrajectoriesConfig(AppConfig):
    name = "apps.trajectories"
    label = "trajectories"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db import transaction
        from django.db.models.signals import post_save

        from apps.sandboxes.models import FINAL_STATES, SandboxEvent
        from frontend.nav import NavItem, register_nav

        register_nav(NavItem("Trajectories", "trajectories:list", section="trajectories"))

        def _ended(sender: object, instance: SandboxEvent, created: bool, **_: Any) -> None:
            # A sandbox's cost is final when it ends: the episodes that used it are
            # re-costed after the commit that closed its usage record.
            if created and instance.to_state in FINAL_STATES:
                sandbox_pk = instance.sandbox_id
                transaction.on_commit(lambda: _recost(sandbox_pk))

        post_save.connect(_ended, sender=SandboxEvent, weak=False, dispatch_uid="episode-cost")


def _recost(sandbox_pk: Any) -> None:
    from apps.trajectories.cost import sharing_episodes
    from apps.trajectories.services.episodes import episode_costs_refresh

    episode_costs_refresh(episodes=sharing_episodes(sandbox_pks=[sandbox_pk]))
