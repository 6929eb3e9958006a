from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from apps.sandboxes.backends import get_backend


class Command(BaseCommand):
    help = "Destroys every backend resource of this installation (used by `make down`)."

    def handle(self, *args: Any, **opts: Any) -> None:
        backend = get_backend()
        ids = {item.sandbox_id for item in backend.inventory() if item.sandbox_id}
        for sandbox_id in sorted(ids):
            backend.destroy(sandbox_id)
        # The local backend's agent zygote runs detached from the worker that started
        # it; `make down` stops everything it started, so it goes too.
        zygote = getattr(backend, "zygote", None)
        if zygote is not None:
            zygote.stop()
        self.stdout.write(f"destroyed {len(ids)} sandbox(es)")
