from __future__ import annotations

from django.db import models

from apps.sandboxes.models import Sandbox


class SandboxEnv(models.Model):
    """A sandbox's E2B ``envVars``: every command started through envd gets them (a
    command's own ``envs`` win). Recorded like a REST exec's env, on each operation."""

    sandbox = models.OneToOneField(
        Sandbox, on_delete=models.CASCADE, primary_key=True, related_name="e2b_env"
    )
    env = models.JSONField(default=dict)

    def __str__(self) -> str:
        return f"env of {self.sandbox_id}"
