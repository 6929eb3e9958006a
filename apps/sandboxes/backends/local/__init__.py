"""The local backend: netns + bubblewrap sandboxes on one machine (no Django imports)."""

from .backend import LocalBackend, wait_healthy
from .config import LocalBackendConfig

__all__ = ["LocalBackend", "LocalBackendConfig", "wait_healthy"]
