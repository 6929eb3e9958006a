from __future__ import annotations

import importlib
import os

from celery import Celery
from celery.signals import (
    before_task_publish,
    task_postrun,
    task_prerun,
    worker_init,
    worker_ready,
)

from apps.core.logging import request_id_var

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


# Imported by the first task of each pool process otherwise: the local backend (its
# netlink/nft/zygote modules, libnftables loaded through ctypes) and channels_redis
# (cryptography with it) cost ~0.2 s of CPU per process, paid again by every prefork
# child. Imported once in the parent before the pool forks, they are shared. Only
# imports: nothing here opens a connection or a socket a fork would then share.
WARM_IMPORTS = ("apps.sandboxes.backends.local", "channels_redis.core")


@worker_init.connect
def _warm_imports(**_: object) -> None:
    from django.conf import settings

    for name in WARM_IMPORTS:
        if (
            name.startswith("apps.sandboxes.backends.local")
            and settings.HEDGEROW_BACKEND != "local"
        ):
            continue
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency missing: the task imports it then
            continue


@worker_ready.connect
def _prepare_backend(**_: object) -> None:
    # The pool is up: one of its processes builds what the first provision of a fresh
    # installation would (static helpers, bridge, tables, zygote), ahead of the first
    # burst. Sent, not run here: the parent opens no sockets its next forks would share.
    # Sent by name: this module loads before the apps, so it imports no app's tasks.
    app.send_task("apps.sandboxes.tasks.prepare_backend")
