from __future__ import annotations

import os

from celery import Celery
from celery.signals import before_task_publish, task_postrun, task_prerun

from controlplane.logging import request_id_var

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("hedgerow")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@before_task_publish.connect
def _carry_request_id(headers: dict[str, object] | None = None, **_: object) -> None:
    # The request id follows the request from the API into the worker's logs.
    if headers is not None and request_id_var.get():
        headers["hedgerow_request_id"] = request_id_var.get()


@task_prerun.connect
def _restore_request_id(task: object = None, **_: object) -> None:
    request = getattr(task, "request", None)
    request_id = getattr(request, "hedgerow_request_id", None) if request else None
    request_id_var.set(str(request_id) if request_id else "")


@task_postrun.connect
def _clear_request_id(**_: object) -> None:
    request_id_var.set("")
