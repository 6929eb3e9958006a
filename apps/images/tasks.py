"""Thin Celery task: the pull runs in a worker, the row carries its progress."""

from __future__ import annotations

from celery import shared_task

from apps.images import services


@shared_task(acks_late=True, reject_on_worker_lost=True, soft_time_limit=1800, time_limit=1900)
def pull_image(image_id: str) -> None:
    services.image_pull_run(image_id=image_id)
