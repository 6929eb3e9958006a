from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.db import DatabaseError

from apps.sandboxes.backends import get_backend
from apps.sandboxes.services.warm_pool import warm_pool_forget


class Command(BaseCommand):
    help = "Destroys every backend resource of this installation (used by `make down`)."

    def handle(self, *args: Any, **opts: Any) -> None:
        backend = get_backend()
        # Warm pool members' rows go first, so no row is left naming a member whose
        # resources are destroyed below with everything else listed.
        try:
            drained = warm_pool_forget()
        except DatabaseError as exc:  # the database may already be down at `make down`
            self.stderr.write(f"warm pool rows not removed: {exc}")
            drained = 0
        ids = {item.sandbox_id for item in backend.inventory() if item.sandbox_id}
        for sandbox_id in sorted(ids):
            backend.destroy(sandbox_id)
        # The local backend's agent zygote runs detached from the worker that started
        # it; `make down` stops everything it started, so it goes too.
        zygote = getattr(backend, "zygote", None)
        if zygote is not None:
            zygote.stop()
        # and so does its DNS resolver (egress allowlists, docs/egress.md)
        stop_resolver = getattr(backend, "stop_resolver", None)
        if stop_resolver is not None:
            stop_resolver()
        # Then the local backend's sandbox storage: unmounted (its loop device goes
        # with it), the image kept for the next `make up`.
        release_storage = getattr(backend, "release_storage", None)
        if release_storage is not None:
            release_storage()
        self.stdout.write(f"destroyed {len(ids)} sandbox(es), {drained} warm pool member(s)")
