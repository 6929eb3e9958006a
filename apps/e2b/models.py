from __future__ import annotations

from django.db import models

from apps.sandboxes.models import Sandbox


class SandboxEnv(models.Model):
    """A sandbox's E2B ``envVars``: every command started through envd gets them (a
    command's own ``envs`` win). Recorded like a REST exec's env, on each operation:
    ``env`` holds the names (values ``[redacted]``), ``env_sealed`` the values, Fernet-
    encrypted under the key outside the database (apps/core/crypto.py)."""

    sandbox = models.OneToOneField(
        Sandbox, on_delete=models.CASCADE, primary_key=True, related_name="e2b_env"
    )
    env = models.JSONField(default=dict)
    env_sealed = models.TextField(default="", blank=True)

    def __str__(self) -> str:
        return f"env of {self.sandbox_id}"
