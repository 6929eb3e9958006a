"""Keeps the difficulty aggregates current as episodes close, are re-attributed,
relabeled, imported or deleted: every one of those saves the Episode row."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_save, pre_delete

from apps.trajectories.models import Episode


def _saved(sender: Any, instance: Episode, raw: bool = False, **kwargs: Any) -> None:
    if raw:  # loaddata
        return
    from apps.datasets.services.difficulty import episode_counted

    episode_counted(instance)


def _deleted(sender: Any, instance: Episode, **kwargs: Any) -> None:
    from apps.datasets.services.difficulty import episode_uncounted

    episode_uncounted(instance)


def connect() -> None:
    post_save.connect(_saved, sender=Episode, dispatch_uid="datasets.episode_saved")
    pre_delete.connect(_deleted, sender=Episode, dispatch_uid="datasets.episode_deleted")
