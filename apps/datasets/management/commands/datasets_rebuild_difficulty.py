"""Recomputes the difficulty aggregates from the episodes: after installing the app on a
database that already holds episodes, or after changing HEDGEROW_DIFFICULTY_DECAY."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from apps.datasets.services.difficulty import difficulty_rebuild


class Command(BaseCommand):
    help = "Recompute task difficulty aggregates from every closed episode."

    def handle(self, *args: Any, **options: Any) -> None:
        n = difficulty_rebuild()
        self.stdout.write(f"counted {n} episodes")
