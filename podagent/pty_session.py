"""PTY sessions over an upgraded HTTP connection (not yet implemented)."""

from __future__ import annotations

from typing import Any

from .errors import ApiError


def serve_pty(handler: Any) -> None:
    raise ApiError(501, "not_implemented", "pty is not implemented yet")
