from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from apps.sandboxes.services.audit import audit_run
from apps.sandboxes.services.reconcile import sandbox_reconcile


class Command(BaseCommand):
    help = (
        "Runs an installation-wide leak audit now (a reconciler round first with "
        "--reconcile; reclaiming what it finds with --reclaim), in this process (the staff "
        "page's 'Run audit now' asks a worker for the same). On Kubernetes run it in a "
        "worker pod: the only account that may delete sandbox resources "
        "(docs/deploy-kubernetes.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--reconcile", action="store_true")
        parser.add_argument("--reclaim", action="store_true")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["reconcile"]:
            round_ = sandbox_reconcile()
            self.stdout.write(f"reconcile: {round_.skip_reason or round_.actions}")
        run = audit_run(reclaim=opts["reclaim"], trigger="manual")
        balanced = "balanced" if run.balanced else "NOT balanced"
        self.stdout.write(
            f"audit {run.pk}: {balanced}, leaked {run.leaked}, orphaned {run.orphaned}, "
            f"reclaimed {run.reclaimed}"
        )
