from __future__ import annotations

import logging
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from apps.sandboxes.services.watching import watch_backend_once

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Watches the backend and marks ready sandboxes whose resources vanished as lost."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one pass, then exit")
        parser.add_argument("--interval", type=float, default=2.0)

    def handle(self, *args: Any, **opts: Any) -> None:
        while True:
            try:
                watch_backend_once(timeout_s=opts["interval"])
            except Exception:
                log.exception("watch pass failed")
            if opts["once"]:
                return
