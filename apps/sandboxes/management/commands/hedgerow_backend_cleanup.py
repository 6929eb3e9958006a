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
        self.stdout.write(f"destroyed {len(ids)} sandbox(es)")
